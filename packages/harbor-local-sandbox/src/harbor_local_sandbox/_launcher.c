/* launcher: a process parked in a box's cgroups ahead of time, which becomes its bubblewrap;
 * and the step before every box's bubblewrap that gives it a mount table of its own.
 *
 *   launcher FD
 *   launcher --private-mounts STATE_ROOT KEEP COMMAND...
 *
 * Moving a process into cgroups waits for a kernel grace period (~10 ms after a quiet spell);
 * a process forked inside them is counted there at once. The host starts this program, moves it
 * into fresh cgroups in the background, and when a box starts sends it one message on the
 * SOCK_SEQPACKET socket FD: the payload is NUL-terminated strings, first the count K of
 * descriptors, then K descriptor numbers, then the command line; the message carries the K
 * descriptors (SCM_RIGHTS). It places each received descriptor at its number and executes the
 * command (bubblewrap), which inherits the cgroups. It dies with its parent (PR_SET_PDEATHSIG, kept
 * across exec), and exits quietly when the socket closes without a message.
 * A command line may begin with "--private-mounts STATE_ROOT KEEP": the command then runs in a mount
 * namespace of its own (a private copy of this one) from which every mount under STATE_ROOT but
 * those of its top-level folder KEEP is detached: the other sandboxes' trees. bubblewrap copies
 * the mount table into the box and reads it whole once per mount it makes (~20 per box), so
 * without this each start grew slower with every sandbox already running (2 mounts each).
 * Exit codes: 0 closed without a message, 125 cannot make the mount namespace, 126 bad message,
 * 127 cannot execute.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_FDS 16
#define MAX_ARGS 4096
#define PAYLOAD (1 << 20)

/* The whole of /proc/self/mountinfo, NUL-terminated (read before any change: a table read while it
 * changes may skip lines), or NULL. */
static char *read_mount_table(void) {
    int fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NULL;
    size_t size = 0, capacity = 1 << 16;
    char *table = malloc(capacity);
    for (ssize_t n = 1; table != NULL && n > 0;) {
        if (capacity - size < 4096) table = realloc(table, capacity *= 2);
        if (table == NULL) break;
        do n = read(fd, table + size, capacity - size - 1); while (n < 0 && errno == EINTR);
        if (n < 0) {
            free(table);
            table = NULL;
        } else {
            size += (size_t)n;
        }
    }
    close(fd);
    if (table != NULL) table[size] = 0;
    return table;
}

/* Unshare the mount namespace, and detach the mounts under root/ but those of root/keep. */
static int private_mounts(const char *root, const char *keep) {
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return -1;
    char *table = read_mount_table();
    if (table == NULL) return -1;
    size_t n_root = strlen(root), n_keep = strlen(keep);
    static char point[PATH_MAX];
    for (char *line = strtok(table, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        /* The fifth field is the mount point (octal escapes for spaces: such a root matches nothing). */
        if (sscanf(line, "%*s %*s %*s %*s %4095s", point) != 1) continue;
        if (strncmp(point, root, n_root) != 0 || point[n_root] != '/') continue;
        const char *top = point + n_root + 1;
        if (strncmp(top, keep, n_keep) == 0 && (top[n_keep] == 0 || top[n_keep] == '/')) continue;
        umount2(point, MNT_DETACH); /* fails harmlessly where a mount above it went already */
    }
    free(table);
    return 0;
}

/* Execute a command line (after "--private-mounts ROOT KEEP", if it begins so). */
static int run(char **command) {
    if (command[0] != NULL && strcmp(command[0], "--private-mounts") == 0) {
        if (command[1] == NULL || command[2] == NULL || command[3] == NULL) return 126;
        if (private_mounts(command[1], command[2]) != 0) {
            fprintf(stderr, "launcher: cannot make the sandbox's mount namespace: %s\n", strerror(errno));
            return 125;
        }
        command += 3;
    }
    execv(command[0], command);
    fprintf(stderr, "launcher: cannot execute %s: %s\n", command[0], strerror(errno));
    return 127;
}

int main(int argc, char **argv) {
    if (argc < 2) return 126;
    if (strcmp(argv[1], "--private-mounts") == 0) return run(argv + 1);
    pid_t parent = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) return 126;
    int sock = atoi(argv[1]);
    static char payload[PAYLOAD + 1];
    char control[CMSG_SPACE(sizeof(int) * MAX_FDS)];
    struct iovec iov = {payload, PAYLOAD};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t size;
    do {
        size = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    } while (size < 0 && errno == EINTR);
    if (size == 0) return 0;
    if (size < 0 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) return 126;
    payload[size] = 0;

    int received[MAX_FDS], n_received = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        if (n_received + n > MAX_FDS) return 126;
        memcpy(received + n_received, CMSG_DATA(c), sizeof(int) * n);
        n_received += n;
    }

    char *fields[MAX_ARGS + 1];
    int n_fields = 0;
    for (char *p = payload; p < payload + size && n_fields < MAX_ARGS; p += strlen(p) + 1) fields[n_fields++] = p;
    if (n_fields < 1) return 126;
    int k = atoi(fields[0]);
    if (k != n_received || n_fields < 1 + k + 1) return 126;

    /* Out of the way first (a wanted number may be another received descriptor's), then in place. */
    for (int i = 0; i < k; i++) {
        int high = fcntl(received[i], F_DUPFD_CLOEXEC, 1024);
        if (high < 0) return 126;
        close(received[i]);
        received[i] = high;
    }
    close(sock);
    for (int i = 0; i < k; i++) {
        int wanted = atoi(fields[1 + i]);
        if (wanted < 3 || dup2(received[i], wanted) < 0) return 126; /* dup2 clears close-on-exec */
        close(received[i]);
    }
    char **command = fields + 1 + k;
    fields[n_fields] = NULL;
    return run(command);
}
