/* launcher: a process parked in a box's cgroups ahead of time, which becomes its bubblewrap;
 * and the step before every box's bubblewrap that gives it a mount table of its own.
 *
 *   launcher FD
 *   launcher [--die-with-parent] [--join-cgroups FD[,FD...]] --private-mounts STATE_ROOT KEEP COMMAND...
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
 * namespace of its own (a private copy of this one) holding only the mounts it needs (private_mounts):
 * its top-level folder KEEP under STATE_ROOT, /proc, /dev, and what holds the paths it names. bubblewrap
 * copies the mount table into the box and reads it whole once per mount it makes (~20 per box): the
 * other sandboxes' trees (2 mounts each) made each start slower with every sandbox already running,
 * and the host's own mounts (cgroup hierarchies, image roots) cost every start.
 * With "--die-with-parent" first, the command dies with this program's parent (PR_SET_PDEATHSIG,
 * armed before exec: bubblewrap's own --die-with-parent arms only part-way through its set-up), as
 * `setpriv --pdeathsig KILL` would, without a program more to execute on every start. With
 * "--join-cgroups", it first puts itself in the box's cgroups (each FD the cgroup.procs of one,
 * opened by the host; closed after): bubblewrap and all it forks start there, with nothing to move
 * from the host afterwards (the host's first move after a quiet spell waited for a grace period).
 * Exit codes: 0 closed without a message, 124 cannot join the cgroups, 125 cannot make the mount
 * namespace, 126 bad message, 127 cannot execute.
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
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#define OPEN_TREE_CLONE_ 1
#define AT_RECURSIVE_ 0x8000
#define MOVE_MOUNT_F_EMPTY_PATH_ 0x4
#define STATX_MNT_ID_ 0x1000U

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

/* Whether path is top or below it ("/" is above everything). */
static int below(const char *path, const char *top) {
    size_t n = strlen(top);
    if (n == 1 && top[0] == '/') return 1;
    return strncmp(path, top, n) == 0 && (path[n] == 0 || path[n] == '/');
}

#define MAX_NAMED 1024

/* The mount ID of path (0: unknown). */
static unsigned long long mount_id(const char *path) {
    struct statx stx;
    if (statx(AT_FDCWD, path, AT_NO_AUTOMOUNT | AT_SYMLINK_NOFOLLOW, STATX_MNT_ID_, &stx) != 0) return 0;
    return (stx.stx_mask & STATX_MNT_ID_) ? stx.stx_mnt_id : 0;
}

/* Where the mount that holds path is mounted (into point), found by walking up until the mount
 * changes. 0 on success. */
static int holding_mount(const char *path, char *point) {
    unsigned long long id = mount_id(path);
    if (id == 0 || strlen(path) >= PATH_MAX) return -1;
    strcpy(point, path);
    for (;;) {
        char *slash = strrchr(point, '/');
        if (slash == NULL || slash == point) {
            if (mount_id("/") != id) return 0; /* point is the mount's top */
            strcpy(point, "/");
            return 0;
        }
        *slash = 0;
        if (mount_id(point) != id) {
            *slash = '/';
            return 0;
        }
    }
}

/* The other sandboxes' trees all at once: detach the whole mount that holds the state root (a
 * tmpfs such as /dev/shm: every tree is mounted below it) after cloning the box's own tree, then
 * put the clone back at its path on a fresh tmpfs. One detach instead of one per sandbox running
 * (each waits for the kernel's RCU), and the table read afterwards holds none of their mounts.
 * Not where that mount is "/" or holds a path the command names (below it, outside the box): 1 then, and
 * the caller detaches them one by one. 0 done, 1 not done, -1 failed. */
static int detach_other_trees(const char *root, char *box, char **named, int n_named) {
    static char base[PATH_MAX];
    if (holding_mount(root, base) != 0 || strcmp(base, "/") == 0) return 1;
    for (int i = 0; i < n_named; i++) /* (a name of the mount itself is bubblewrap's, in the box: "/dev/shm") */
        if (below(named[i], base) && strcmp(named[i], base) != 0 && !below(named[i], box)) return 1;
    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, box, OPEN_TREE_CLONE_ | AT_RECURSIVE_ | O_CLOEXEC);
    if (tree < 0) return 1;
    if (umount2(base, MNT_DETACH) != 0) { /* locked (a user namespace's copy of the host's mounts) */
        close(tree);
        return 1;
    }
    int rc = mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k");
    /* the folders down to the box, then the box's tree on the last one */
    for (char *slash = box + strlen(base) + 1; rc == 0 && (slash = strchr(slash, '/')) != NULL; slash++) {
        *slash = 0;
        rc = mkdir(box, 0700) != 0 && errno != EEXIST ? -1 : 0;
        *slash = '/';
    }
    if (rc == 0) rc = mkdir(box, 0700) != 0 && errno != EEXIST ? -1 : 0;
    if (rc == 0) rc = (int)syscall(SYS_move_mount, tree, "", AT_FDCWD, box, MOVE_MOUNT_F_EMPTY_PATH_);
    close(tree);
    return rc == 0 ? 0 : -1;
}

/* Unshare the mount namespace and detach every mount the command does not need: it keeps "/",
 * /proc, /dev and root/keep (the box's own tree) with all below them (but the other sandboxes'
 * trees under root/, wherever root is), and the mounts that hold a
 * path the command names (each absolute argument, links resolved: bubblewrap's bind sources, the
 * programs). The rest goes: the other sandboxes' trees under root/, the image roots, /sys and its
 * cgroup hierarchies, ... bubblewrap reads the whole table once per mount it makes, so each line
 * costs every start (most of bubblewrap's time went to printing and parsing it). A mount point the
 * kernel printed escaped (a space in it) is kept. */
static int private_mounts(const char *root, const char *keep, char **command) {
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return -1;
    static char box[PATH_MAX];
    snprintf(box, sizeof box, "%s/%s", root, keep);
    const char *whole[] = {"/proc", "/dev", box};
    static char *named[MAX_NAMED];
    int n_named = 0;
    for (char **arg = command; *arg != NULL && n_named < MAX_NAMED; arg++) {
        if ((*arg)[0] != '/') continue;
        char *resolved = realpath(*arg, NULL);
        named[n_named++] = resolved != NULL ? resolved : *arg;
    }
    if (detach_other_trees(root, box, named, n_named) < 0) return -1;
    char *table = read_mount_table();
    if (table == NULL) return -1;
    static char point[PATH_MAX];
    for (char *line = strtok(table, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        /* The fifth field is the mount point. */
        if (sscanf(line, "%*s %*s %*s %*s %4095s", point) != 1 || strchr(point, '\\') != NULL) continue;
        int needed = strcmp(point, "/") == 0;
        if (below(point, root) && strcmp(point, root) != 0) /* the sandboxes' trees: this box's only */
            needed = below(point, box) || below(box, point);
        for (size_t i = 0; !needed && !below(point, root) && i < sizeof whole / sizeof *whole; i++)
            needed = below(point, whole[i]) || below(whole[i], point);
        for (int i = 0; !needed && i < n_named; i++) needed = below(named[i], point);
        if (!needed) umount2(point, MNT_DETACH); /* fails harmlessly where a mount above it went already */
    }
    free(table);
    return 0;
}

/* Put this process in the cgroups whose cgroup.procs the comma-separated descriptors are (opened
 * by the host), and close them: "0" is the writer. 0 on success. */
static int join_cgroups(const char *list) {
    int rc = 0;
    for (const char *p = list; *p;) {
        char *end;
        long fd = strtol(p, &end, 10);
        if (end == p || fd < 3) return -1;
        if (rc == 0 && write((int)fd, "0", 1) != 1) rc = -1;
        close((int)fd);
        p = *end == ',' ? end + 1 : end;
    }
    return rc;
}

static int die_with_parent(void);

/* Execute a command line after its options, in this order where given: "--die-with-parent",
 * "--join-cgroups FD[,FD...]", "--private-mounts ROOT KEEP". */
static int run(char **command) {
    if (command[0] != NULL && strcmp(command[0], "--die-with-parent") == 0) {
        if (die_with_parent() != 0) return 126;
        command += 1;
    }
    if (command[0] != NULL && strcmp(command[0], "--join-cgroups") == 0) {
        if (command[1] == NULL) return 126;
        if (join_cgroups(command[1]) != 0) {
            fprintf(stderr, "launcher: cannot join the sandbox's cgroups: %s\n", strerror(errno));
            return 124;
        }
        command += 2;
    }
    if (command[0] != NULL && strcmp(command[0], "--private-mounts") == 0) {
        if (command[1] == NULL || command[2] == NULL || command[3] == NULL) return 126;
        if (private_mounts(command[1], command[2], command + 3) != 0) {
            fprintf(stderr, "launcher: cannot make the sandbox's mount namespace: %s\n", strerror(errno));
            return 125;
        }
        command += 3;
    }
    if (command[0] == NULL) return 126;
    execv(command[0], command);
    fprintf(stderr, "launcher: cannot execute %s: %s\n", command[0], strerror(errno));
    return 127;
}

/* Die with the parent from now on (0), or 126 where it is gone already. */
static int die_with_parent(void) {
    pid_t parent = getppid();
    return prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent ? 126 : 0;
}

int main(int argc, char **argv) {
    if (argc < 2) return 126;
    if (strncmp(argv[1], "--", 2) == 0) return run(argv + 1);
    if (die_with_parent()) return 126;
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
