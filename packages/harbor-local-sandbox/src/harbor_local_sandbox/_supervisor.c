/*
 * The processes that live inside a local sandbox for its whole life: its keel, its agent's
 * supervisor, and, while it is graded, its verifier's.
 *
 * Compiled statically on first use by _binaries.py and cached by source hash; it is passed to
 * bubblewrap as an open file descriptor, so it appears nowhere in the sandbox's file system, and
 * it needs nothing of the image (which may have no C library at all).
 *
 *   usage: supervisor CONTROL_FD AGENT_FD AS_LIMIT_BYTES NPROC_LIMIT CAPS_HEX
 *              [ro:N|file:N|dir:N|links|link-forbidden:PATH|link-hazard:KIND:PATH|cgroup-procs:FD]...
 *          supervisor judge-link [link-forbidden:PATH|link-hazard:KIND:PATH]...   (targets on stdin)
 *
 * It starts as the init of the sandbox's outer PID namespace (bubblewrap --as-pid-1): the *keel*.
 * The keel forks the *agent's supervisor* into a PID and mount namespace of its own, nested in the
 * keel's: the agent's processes live there, with a /proc of their own (hardened: the ro:/file:/dir:
 * entries make /proc/N read-only or mask it, as Docker does) and the capabilities CAPS_HEX, and see
 * nothing of the keel's namespace. Later, the keel forks the *verifier's supervisor* beside the
 * agent's, in the keel's PID namespace (so the verifier sees and can signal the agent's processes,
 * which cannot see it) with mount, network, IPC and UTS namespaces of its own: its root is a mount
 * tree the host made and sent as a descriptor.
 *
 * The host hands over two listening Unix sockets: CONTROL_FD (the keel's) and AGENT_FD (the agent's
 * supervisor's); the verifier's comes with its request. Each connection carries one request,
 * little-endian, with descriptors (SCM_RIGHTS) where a request needs them:
 *
 *   request:  u32 size | u32 timeout_ms (0: none) | u32 cap | u32 n | n x (u32 len | bytes)
 *             fields: cwd, command, then "KEY=VALUE" environment entries. An empty cwd marks a
 *             control request:
 *               "ps"               the agent's processes ("PID:START" lines; the agent's supervisor
 *                                  and the keel's handler excluded; keel numbering);
 *               "kill" [KEEP...]   kills all of them but the "PID:START" entries KEEP, and answers
 *                                  how many it killed;
 *               "view" HOST        (keel; descriptors: the view's root tree, its listening socket, the
 *                                  forwarder program, optional) starts the verifier's supervisor and
 *                                  the forwarder of the agent's TCP ports (_forwarder.c); answers the
 *                                  supervisor's PID (keel numbering) once both serve; the
 *                                  verifier's supervisor first forks the watcher of the view's
 *                                  PATH folders when the view lists commands the agent added there
 *                                  (COMMANDS_FILE, watch_commands);
 *               "unview PID"       (keel) kills every process of that verifier's network namespace;
 *   response: i32 exit code | u32 flags (1: timed out)
 *             | stdout: u64 dropped | u32 len | bytes | stderr: the same
 *
 * Every command connection is served by a forked handler that makes itself a child subreaper, so
 * every process the command starts (even one that calls setsid and double-forks) stays its
 * descendant. A timeout, or the host closing the connection (a cancelled exec), kills that whole
 * tree. Processes a finished command left in the background keep running, as with `docker exec`
 * into a running container. Output is bounded: at most `cap` bytes per stream are kept (the head
 * and the tail, with a marker in between); the rest is read and dropped so the command never
 * blocks on a full pipe.
 *
 * Before anything else the keel forbids new user namespaces in the sandbox's (whose root would
 * regain every capability there): user.max_user_namespaces = 0, which only a process with
 * CAP_SYS_RESOURCE in this namespace may raise again; the keel gives that capability up at once
 * (commands never have it). Each cgroup-procs:FD is the agent's cgroup leaf's cgroup.procs, opened
 * by the host (one per controller): the keel writes the agent's supervisor there as soon as it
 * forks it, so every process of the agent starts under the agent's limits, and closes them.
 *
 * The keel is the init of its PID namespace, the agent's supervisor of its own: the kernel never
 * delivers SIGKILL or SIGSTOP to a namespace's init from inside it. None of the three is dumpable;
 * commands run with CAPS_HEX only (no CAP_SYS_ADMIN, no CAP_SYS_PTRACE), so the agent can neither
 * trace nor unmount anything. The keel keeps what it needs to make the verifier's namespaces.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_fsopen
#define SYS_fsopen 430
#endif
#ifndef SYS_fsconfig
#define SYS_fsconfig 431
#endif
#ifndef SYS_fsmount
#define SYS_fsmount 432
#endif
#define OPEN_TREE_CLONE_ 1
#define AT_RECURSIVE_ 0x8000
#define MOVE_MOUNT_F_EMPTY_PATH_ 0x4
#define FSCONFIG_CMD_CREATE_ 6
#define MOUNT_ATTR_NOSUID_ 0x2
#define MOUNT_ATTR_NODEV_ 0x4
#define MOUNT_ATTR_NOEXEC_ 0x8
#define DRAIN_GRACE_MS 50
#define MAX_REQUEST (64u << 20)
#define MAX_FDS 4

/* What this process is: the keel, the agent's supervisor, or a verifier's. */
enum role { KEEL, AGENT, VIEW };
static enum role role = KEEL;
/* Set once for every role: the limits and capabilities of the commands, and the /proc hardening. */
static unsigned long long as_limit, nproc_limit, command_caps;
static char **hardening;
static int n_hardening;
/* Whether the agent's links go through the keel (the "links" item; see install_link_filter). */
static int mediate_links;

static int read_full(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int write_full(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static uint32_t get_u32(const char **p) {
    uint32_t v;
    memcpy(&v, *p, 4);
    *p += 4;
    return v;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Keeps the first cap/2 and the last cap - cap/2 bytes of a stream. */
struct bounded {
    char *head, *tail;
    size_t cap_head, cap_tail, n_head, tail_start, n_tail;
    uint64_t dropped;
};

static void bounded_init(struct bounded *b, size_t cap) {
    b->cap_head = cap / 2;
    b->cap_tail = cap - cap / 2;
    b->head = malloc(b->cap_head + 1);
    b->tail = malloc(b->cap_tail + 1);
    b->n_head = b->tail_start = b->n_tail = 0;
    b->dropped = 0;
}

static void bounded_add(struct bounded *b, const char *data, size_t len) {
    size_t room = b->cap_head - b->n_head;
    if (room) {
        size_t take = len < room ? len : room;
        memcpy(b->head + b->n_head, data, take);
        b->n_head += take;
        data += take;
        len -= take;
    }
    for (size_t i = 0; i < len; i++) { /* ring buffer of the tail */
        if (b->n_tail < b->cap_tail) {
            b->tail[(b->tail_start + b->n_tail) % b->cap_tail] = data[i];
            b->n_tail++;
        } else {
            b->tail[b->tail_start] = data[i];
            b->tail_start = (b->tail_start + 1) % b->cap_tail;
            b->dropped++;
        }
    }
}

/* Writes u64 dropped, u32 length, head, marker, tail. */
static int bounded_send(int fd, struct bounded *b) {
    char marker[96] = "";
    if (b->dropped)
        snprintf(marker, sizeof marker, "\n[... %llu bytes omitted ...]\n", (unsigned long long)b->dropped);
    uint32_t total = (uint32_t)(b->n_head + strlen(marker) + b->n_tail);
    char *out = malloc(total + 1);
    size_t off = 0;
    memcpy(out, b->head, b->n_head);
    off += b->n_head;
    memcpy(out + off, marker, strlen(marker));
    off += strlen(marker);
    for (size_t i = 0; i < b->n_tail; i++) out[off++] = b->tail[(b->tail_start + i) % b->cap_tail];
    int rc = write_full(fd, &b->dropped, 8) || write_full(fd, &total, 4) || write_full(fd, out, total);
    free(out);
    return rc;
}

static void reap(void) {
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

/* Kills every descendant of this process, repeating until none is left. */
static void kill_tree(void) {
    pid_t me = getpid();
    for (int round = 0; round < 200; round++) {
        size_t cap = 4096, n = 0;
        pid_t *pids = malloc(cap * sizeof *pids), *ppids = malloc(cap * sizeof *ppids);
        DIR *proc = opendir("/proc");
        struct dirent *entry;
        while (proc && (entry = readdir(proc))) {
            if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
            char path[300], buf[512];
            snprintf(path, sizeof path, "/proc/%s/stat", entry->d_name);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0) continue;
            ssize_t len = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (len <= 0) continue;
            buf[len] = 0;
            char *close_paren = strrchr(buf, ')');
            if (!close_paren) continue;
            char state;
            int ppid;
            if (sscanf(close_paren + 2, "%c %d", &state, &ppid) != 2) continue;
            if (n == cap) {
                cap *= 2;
                pids = realloc(pids, cap * sizeof *pids);
                ppids = realloc(ppids, cap * sizeof *ppids);
            }
            pids[n] = atoi(entry->d_name);
            ppids[n++] = ppid;
        }
        if (proc) closedir(proc);
        /* Breadth-first over the parent links, starting from this process. */
        pid_t *queue = malloc((n + 1) * sizeof *queue);
        size_t head = 0, tail = 0;
        int killed = 0;
        queue[tail++] = me;
        while (head < tail) {
            pid_t parent = queue[head++];
            for (size_t i = 0; i < n; i++) {
                if (ppids[i] == parent && pids[i] != me) {
                    if (kill(pids[i], SIGKILL) == 0) killed = 1;
                    queue[tail++] = pids[i];
                    ppids[i] = -1;
                }
            }
        }
        free(queue);
        free(pids);
        free(ppids);
        reap();
        if (!killed) return;
        struct timespec pause = {0, 5000000};
        nanosleep(&pause, NULL);
    }
}

/* Reads a process's state letter and start time (clock ticks after boot) from
 * /proc/PID/stat; the state is '?' when the process is gone. */
static char proc_stat(const char *pid, unsigned long long *start) {
    char path[300], buf[1024];
    snprintf(path, sizeof path, "/proc/%s/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return '?';
    ssize_t len = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (len <= 0) return '?';
    buf[len] = 0;
    char *close_paren = strrchr(buf, ')');
    if (!close_paren || !close_paren[1] || !close_paren[2]) return '?';
    char state = close_paren[2];
    /* After the state come 18 fields, then the start time (field 22 of the line). */
    char *p = close_paren + 3;
    for (int field = 0; field < 18 && p; field++) p = strchr(p + 1, ' ');
    *start = p ? strtoull(p + 1, NULL, 10) : 0;
    return state;
}

/* Whether a process is one of the agent's, seen from the keel: its NSpid line has two numbers (the
 * keel's, then the agent namespace's), and the second is not 1 (the agent's supervisor). In the
 * agent's own namespace every process but its supervisor is. */
static int is_agents(const char *pid) {
    if (role != KEEL) return atoi(pid) != 1;
    char path[300], buf[4096];
    snprintf(path, sizeof path, "/proc/%s/status", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t len = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (len <= 0) return 0;
    buf[len] = 0;
    char *line = strstr(buf, "\nNSpid:");
    if (!line) return 0;
    line += 7;
    long first, second;
    char *end;
    first = strtol(line, &end, 10);
    if (end == line) return 0;
    line = end;
    second = strtol(line, &end, 10);
    (void)first;
    return end != line && second != 1;
}

/* The agent's live processes, one "PID:START" line each (this handler excluded). */
static size_t list_processes(char **out) {
    size_t cap = 4096, len = 0;
    char *text = malloc(cap);
    DIR *proc = opendir("/proc");
    struct dirent *entry;
    pid_t me = getpid();
    while (proc && (entry = readdir(proc))) {
        if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
        pid_t pid = (pid_t)atoi(entry->d_name);
        unsigned long long start;
        if (pid == me || !is_agents(entry->d_name)) continue;
        char state = proc_stat(entry->d_name, &start);
        if (state == 'Z' || state == 'X' || state == '?') continue;
        if (len + 64 > cap) text = realloc(text, cap *= 2);
        len += (size_t)snprintf(text + len, cap - len, "%d:%llu\n", (int)pid, start);
    }
    if (proc) closedir(proc);
    *out = text;
    return len;
}

/* Kills every process the filter selects but this handler and the "PID:START" entries of keep,
 * repeating until a scan finds none to kill; returns how many were killed. Every process is
 * reachable this way, whatever it did to detach (new session, double fork, ignoring SIGTERM). */
static int kill_selected(int (*selected)(const char *, const void *), const void *arg, char **keep, uint32_t nkeep) {
    pid_t me = getpid();
    int total = 0;
    for (int round = 0; round < 1000; round++) {
        int killed = 0;
        DIR *proc = opendir("/proc");
        struct dirent *entry;
        while (proc && (entry = readdir(proc))) {
            if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
            pid_t pid = (pid_t)atoi(entry->d_name);
            if (pid == 1 || pid == me || !selected(entry->d_name, arg)) continue;
            unsigned long long start;
            char state = proc_stat(entry->d_name, &start);
            if (state == 'Z' || state == 'X' || state == '?') continue;
            char id[64];
            snprintf(id, sizeof id, "%d:%llu", (int)pid, start);
            int kept = 0;
            for (uint32_t i = 0; i < nkeep && !kept; i++) kept = strcmp(keep[i], id) == 0;
            if (!kept && kill(pid, SIGKILL) == 0) killed++;
        }
        if (proc) closedir(proc);
        total += killed;
        if (!killed) break;
        struct timespec pause = {0, 500000}; /* what was forked meanwhile shows in the next scan */
        nanosleep(&pause, NULL);
    }
    return total;
}

static int agents_filter(const char *pid, const void *arg) {
    (void)arg;
    return is_agents(pid);
}

/* The inode of a process's network namespace (0 when it is gone). */
static unsigned long long net_inode(const char *pid) {
    char path[300];
    struct stat info;
    snprintf(path, sizeof path, "/proc/%s/ns/net", pid);
    return stat(path, &info) == 0 ? (unsigned long long)info.st_ino : 0;
}

static int in_net_filter(const char *pid, const void *arg) {
    unsigned long long want = *(const unsigned long long *)arg;
    return want && net_inode(pid) == want;
}

/* Answers a control request: an exit code and stdout, no stderr. */
static void answer_control(int conn, int32_t rc, const char *text, size_t len) {
    uint32_t flags = 0, size = (uint32_t)len, zero = 0;
    uint64_t none = 0;
    if (!write_full(conn, &rc, 4) && !write_full(conn, &flags, 4) && !write_full(conn, &none, 8) &&
        !write_full(conn, &size, 4) && !write_full(conn, text, len) && !write_full(conn, &none, 8))
        write_full(conn, &zero, 4);
    close(conn);
}

/* Answers a command that could not be started: an exit code and a message on stderr. */
static void answer_failure(int conn, int32_t rc, const char *what, int error) {
    char text[256];
    int len = snprintf(text, sizeof text, "cannot start the command: %s: %s%s\n", what, strerror(error),
                       error == EAGAIN ? " (the sandbox is at its process limit)" : "");
    uint32_t flags = 0, size = (uint32_t)len, zero = 0;
    uint64_t none = 0;
    if (!write_full(conn, &rc, 4) && !write_full(conn, &flags, 4) && !write_full(conn, &none, 8) &&
        !write_full(conn, &zero, 4) && !write_full(conn, &none, 8) && !write_full(conn, &size, 4))
        write_full(conn, text, (size_t)len);
    close(conn);
}

/* Sends fd (or only a byte, when fd < 0) over the socket s. */
static void send_fd(int s, int fd) {
    char byte = 0;
    struct iovec iov = {&byte, 1};
    char control[CMSG_SPACE(sizeof(int))];
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fd >= 0) {
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    while (sendmsg(s, &msg, 0) < 0 && errno == EINTR) {
    }
}

/* The byte sent by send_fd (in *byte, -1 when none came), and the descriptor with it, or -1. */
static int receive_byte_fd(int s, int *byte) {
    char one, control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&one, 1};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    *byte = -1;
    if (recvmsg(s, &msg, MSG_CMSG_CLOEXEC) <= 0) return -1;
    *byte = (unsigned char)one;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    int fd = -1;
    if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* The descriptor sent by send_fd, or -1. */
static int receive_fd(int s) {
    int byte;
    return receive_byte_fd(s, &byte);
}

/* ---- The agent's symbolic links ------------------------------------------------------------------
 *
 * The verifier reads the agent's files live, so a link the agent makes is followed in the verifier's
 * world, where /tests, /solution, /logs/verifier and the verifier's own /proc exist: an answer file
 * that is a link to /tests/expected.txt would read the expected answer. So every symlink(2) and
 * symlinkat(2) of the agent's processes stops at a seccomp filter installed by the agent's
 * supervisor (inherited by every process it starts) and goes to the keel, which judges the link by
 * its target alone — wherever the link is made or later moved — and makes it itself, with the
 * caller's root, working directory, credentials and capabilities (the target is read once, from the
 * caller's memory: what was judged is what is made). A link that could lead into the verifier's own
 * places is refused (EPERM). io_uring, which would make links past the filter, is refused too
 * (ENOSYS), as under Docker's default profile.
 */

#ifndef SYS_seccomp
#define SYS_seccomp 317
#endif
#ifndef SECCOMP_FILTER_FLAG_NEW_LISTENER
#define SECCOMP_FILTER_FLAG_NEW_LISTENER (1UL << 3)
#endif
#ifndef SECCOMP_RET_USER_NOTIF
#define SECCOMP_RET_USER_NOTIF 0x7fc00000U
#endif

/* The link policy: the places no link of the agent's may lead into (link-forbidden:PATH items),
 * the folders above them (computed), and the image's own links that lead into one or to such a
 * folder (link-hazard:into:PATH, link-hazard:ancestor:PATH) — from the command line, made by
 * _links.py from the one table of code_places.py. judge_link walks a target as _links.LinkPolicy
 * does (see there why): 0 (made), 1 (it can lead into a forbidden place), 2 (it can end at a
 * folder above one). */
#define MAX_LINK_PLACES 64
static const char *forbidden[MAX_LINK_PLACES];
static char ancestors[MAX_LINK_PLACES * 8][PATH_MAX / 16];
static int n_forbidden, n_ancestors;
static const char **hazard_paths; /* the image's links in a folder above a forbidden place */
static char *hazard_kinds;         /* 'i' (into) or 'a' (ancestor) */
static int n_hazards;
static const char **hazard_names; /* the names of its other such links (matched by name only) */
static char *hazard_name_kinds;
static int n_hazard_names;

static int is_ancestor(const char *path) {
    for (int i = 0; i < n_ancestors; i++)
        if (strcmp(ancestors[i], path) == 0) return 1;
    return 0;
}

static void add_ancestors(const char *place) {
    char parent[PATH_MAX / 16];
    snprintf(parent, sizeof parent, "%s", place);
    for (;;) {
        char *slash = strrchr(parent, '/');
        if (!slash) return;
        if (slash == parent) slash[1] = 0;
        else *slash = 0;
        if (!is_ancestor(parent) && n_ancestors < (int)(sizeof ancestors / sizeof ancestors[0]))
            snprintf(ancestors[n_ancestors++], sizeof ancestors[0], "%s", parent);
        if (strcmp(parent, "/") == 0) return;
    }
}

/* Reads the link-forbidden: and link-hazard: items of the command line. */
static void read_link_policy(char **items, int n) {
    hazard_paths = calloc((size_t)n + 1, sizeof *hazard_paths);
    hazard_kinds = calloc((size_t)n + 1, 1);
    hazard_names = calloc((size_t)n + 1, sizeof *hazard_names);
    hazard_name_kinds = calloc((size_t)n + 1, 1);
    for (int i = 0; i < n; i++) {
        const char *item = items[i];
        if (strncmp(item, "link-forbidden:/", 16) == 0 && n_forbidden < MAX_LINK_PLACES &&
            strlen(item + 15) < sizeof ancestors[0]) {
            forbidden[n_forbidden++] = item + 15;
            add_ancestors(item + 15);
        } else if (hazard_paths && strncmp(item, "link-hazard:into:/", 18) == 0) {
            hazard_kinds[n_hazards] = 'i';
            hazard_paths[n_hazards++] = item + 17;
        } else if (hazard_paths && strncmp(item, "link-hazard:ancestor:/", 22) == 0) {
            hazard_kinds[n_hazards] = 'a';
            hazard_paths[n_hazards++] = item + 21;
        } else if (hazard_names && strncmp(item, "link-hazard-name:into:", 22) == 0 && !strchr(item + 22, '/')) {
            hazard_name_kinds[n_hazard_names] = 'i';
            hazard_names[n_hazard_names++] = item + 22;
        } else if (hazard_names && strncmp(item, "link-hazard-name:ancestor:", 26) == 0 && !strchr(item + 26, '/')) {
            hazard_name_kinds[n_hazard_names] = 'a';
            hazard_names[n_hazard_names++] = item + 26;
        }
    }
    if (!is_ancestor("/") && n_ancestors < (int)(sizeof ancestors / sizeof ancestors[0]))
        snprintf(ancestors[n_ancestors++], sizeof ancestors[0], "/");
}

/* Whether name is the last component of one of the n paths. */
static int base_name_of(const char *name, const char *const *paths, int n) {
    for (int i = 0; i < n; i++) {
        const char *slash = strrchr(paths[i], '/');
        if (slash && strcmp(slash + 1, name) == 0) return 1;
    }
    return 0;
}

/* The kind ('i', 'a') of the image's link at path (in a folder above a forbidden place), or 0. */
static char hazard_at(const char *path) {
    char found = 0;
    for (int i = 0; i < n_hazards; i++) {
        if (strcmp(hazard_paths[i], path) != 0) continue;
        if (hazard_kinds[i] == 'i') return 'i';
        found = 'a';
    }
    return found;
}

/* The kind ('i', 'a') of an image link named name: elsewhere only (anywhere 0), or also one in a folder
 * above a forbidden place (anywhere 1); 0 if none. "into" wins. */
static char hazard_named(const char *name, int anywhere) {
    char found = 0;
    for (int i = 0; i < n_hazard_names; i++) {
        if (strcmp(hazard_names[i], name) != 0) continue;
        if (hazard_name_kinds[i] == 'i') return 'i';
        found = 'a';
    }
    for (int i = 0; anywhere && i < n_hazards; i++) {
        const char *slash = strrchr(hazard_paths[i], '/');
        if (!slash || strcmp(slash + 1, name) != 0) continue;
        if (hazard_kinds[i] == 'i') return 'i';
        found = 'a';
    }
    return found;
}

enum { AT_KNOWN, AT_SOMEWHERE, AT_ELSEWHERE };

static int judge_link(const char *target) {
    size_t len = strlen(target);
    if (len == 0 || len > PATH_MAX) return 1;
    const char *ancestor_list[MAX_LINK_PLACES * 8];
    for (int i = 0; i < n_ancestors; i++) ancestor_list[i] = ancestors[i];
    char known[PATH_MAX + 2] = "/", name[PATH_MAX + 1];
    int at = target[0] == '/' ? AT_KNOWN : AT_ELSEWHERE;
    for (const char *p = target; *p;) {
        while (*p == '/') p++;
        size_t n = strcspn(p, "/");
        if (n == 0) break;
        memcpy(name, p, n);
        name[n] = 0;
        p += n;
        if (strcmp(name, ".") == 0) continue;
        if (strcmp(name, "..") == 0) {
            if (at == AT_KNOWN) {
                char *slash = strrchr(known, '/');
                if (slash == known) known[1] = 0;
                else *slash = 0;
            } else {
                at = AT_SOMEWHERE;
            }
            continue;
        }
        char kind;
        if (at == AT_KNOWN) {
            char path[PATH_MAX + 2];
            if (snprintf(path, sizeof path, "%s%s%s", known, strcmp(known, "/") ? "/" : "", name) >= (int)sizeof path)
                return 1;
            for (int i = 0; i < n_forbidden; i++)
                if (strcmp(forbidden[i], path) == 0) return 1;
            if (is_ancestor(path)) {
                snprintf(known, sizeof known, "%s", path);
                continue;
            }
            kind = hazard_at(path);
        } else if (at == AT_SOMEWHERE) {
            if (base_name_of(name, forbidden, n_forbidden)) return 1;
            if (base_name_of(name, ancestor_list, n_ancestors)) continue;
            kind = hazard_named(name, 1);
        } else {
            kind = hazard_named(name, 0);
        }
        if (kind == 'i') return 1;
        at = kind == 'a' ? AT_SOMEWHERE : AT_ELSEWHERE;
    }
    return at == AT_ELSEWHERE ? 0 : 2;
}

/* Installs the link filter on this process (inherited by all it starts); its listener, or -1 where
 * the kernel or the architecture cannot (then links are not mediated). */
static int install_link_filter(void) {
#if defined(__x86_64__)
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 0, 8),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 88, 12, 0),          /* symlink */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 266, 11, 0),         /* symlinkat */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x40000058, 10, 0),  /* x32 symlink */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x4000010a, 9, 0),   /* x32 symlinkat */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 425, 9, 0),          /* io_uring_setup */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x400001a9, 8, 0),   /* x32 io_uring_setup */
        BPF_STMT(BPF_JMP | BPF_JA, 5),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_I386, 0, 4),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 83, 3, 0),           /* i386 symlink */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 304, 2, 0),          /* i386 symlinkat */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 425, 2, 0),          /* i386 io_uring_setup */
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
    };
#elif defined(__aarch64__)
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_AARCH64, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 36, 2, 0),           /* symlinkat */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 425, 2, 0),          /* io_uring_setup */
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
    };
#else
    return -1;
#endif
#if defined(__x86_64__) || defined(__aarch64__)
    struct sock_fprog program = {(unsigned short)(sizeof code / sizeof code[0]), code};
    long fd = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &program);
    return fd < 0 ? -1 : (int)fd;
#endif
}

/* The verifier's bind(2) calls go to the forwarder first, which yields the port to the verifier's
 * own server (_forwarder.c): this filter's listener, or -1 (then the agent's mirrored listeners may
 * keep a port the verifier wants). */
static int install_bind_filter(void) {
#if defined(__x86_64__) || defined(__aarch64__)
#if defined(__x86_64__)
    const unsigned arch = AUDIT_ARCH_X86_64, nr_bind = 49;
#else
    const unsigned arch = AUDIT_ARCH_AARCH64, nr_bind = 200;
#endif
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, arch, 0, 2),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nr_bind, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF),
    };
    struct sock_fprog program = {(unsigned short)(sizeof code / sizeof code[0]), code};
    long fd = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &program);
    return fd < 0 ? -1 : (int)fd;
#else
    return -1;
#endif
}

/* Reads a NUL-terminated string of at most PATH_MAX bytes at address in process pid (via its mem
 * file, open in mem); 0, or an errno. */
static int read_string(int mem, unsigned long long address, char *out) {
    size_t got = 0;
    while (got < PATH_MAX + 1) {
        size_t want = PATH_MAX + 1 - got < 256 ? PATH_MAX + 1 - got : 256;
        ssize_t n = pread(mem, out + got, want, (off_t)(address + got));
        if (n <= 0) return EFAULT;
        if (memchr(out + got, 0, (size_t)n)) return 0;
        got += (size_t)n;
    }
    return ENAMETOOLONG;
}

/* Reads the numbers after "key" in /proc/PID/status into values (at most max); how many. */
static int status_numbers(const char *status, const char *key, unsigned long long *values, int max, int base) {
    const char *line = strstr(status, key);
    if (!line) return 0;
    line += strlen(key);
    int n = 0;
    while (n < max) {
        char *end;
        unsigned long long v = strtoull(line, &end, base);
        if (end == line) break;
        values[n++] = v;
        line = end;
        if (*line == '\n') break;
    }
    return n;
}

/* Makes the link as process pid would: its root, its directory (dirfd, or its working directory),
 * its ids, groups and capabilities, in a child of the keel. 0, or an errno. */
static int make_link_as(pid_t pid, int dirfd, const char *target, const char *linkpath) {
    char path[64], status[8192];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t len = fd < 0 ? -1 : read(fd, status, sizeof status - 1);
    if (fd >= 0) close(fd);
    if (len <= 0) return ESRCH;
    status[len] = 0;
    unsigned long long uid[4], gid[4], groups[64], eff = 0, prm = 0;
    if (status_numbers(status, "\nUid:", uid, 4, 10) != 4 || status_numbers(status, "\nGid:", gid, 4, 10) != 4)
        return ESRCH;
    int ngroups = status_numbers(status, "\nGroups:", groups, 64, 10);
    status_numbers(status, "\nCapEff:", &eff, 1, 16);
    status_numbers(status, "\nCapPrm:", &prm, 1, 16);
    snprintf(path, sizeof path, "/proc/%d/root", (int)pid);
    int root = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dirfd == AT_FDCWD) snprintf(path, sizeof path, "/proc/%d/cwd", (int)pid);
    else snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, dirfd);
    int at = open(path, O_PATH | O_CLOEXEC);
    int result[2];
    if (root < 0 || at < 0 || pipe2(result, O_CLOEXEC) != 0) {
        int error = errno == ENOENT ? EBADF : errno;
        if (root >= 0) close(root);
        if (at >= 0) close(at);
        return error;
    }
    pid_t child = fork();
    if (child == 0) {
        close(result[0]);
        gid_t gs[64];
        for (int i = 0; i < ngroups; i++) gs[i] = (gid_t)groups[i];
        int error = 0;
        if (fchdir(root) || chroot(".") || setgroups((size_t)ngroups, gs) ||
            setresgid((gid_t)gid[0], (gid_t)gid[1], (gid_t)gid[2]) || prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) ||
            setresuid((uid_t)uid[0], (uid_t)uid[1], (uid_t)uid[2]))
            error = errno;
        if (!error) {
            setfsgid((gid_t)gid[3]);
            setfsuid((uid_t)uid[3]);
            struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
            struct __user_cap_data_struct data[2];
            memset(data, 0, sizeof data);
            data[0].effective = (uint32_t)eff, data[1].effective = (uint32_t)(eff >> 32);
            data[0].permitted = (uint32_t)prm, data[1].permitted = (uint32_t)(prm >> 32);
            if (syscall(SYS_capset, &header, data) != 0) error = errno;
        }
        if (!error && symlinkat(target, at, linkpath) != 0) error = errno;
        write_full(result[1], &error, sizeof error);
        _exit(0);
    }
    close(result[1]);
    close(root);
    close(at);
    int error = EAGAIN;
    if (child > 0 && read_full(result[0], &error, sizeof error) != 0) error = EIO;
    close(result[0]);
    return error;
}

/* Answers one notification of the link filter: judges the link, makes it or refuses it. */
static void answer_link_request(int notify) {
    struct seccomp_notif_sizes sizes;
    if (syscall(SYS_seccomp, SECCOMP_GET_NOTIF_SIZES, 0, &sizes) != 0) return;
    struct seccomp_notif *req = calloc(1, sizes.seccomp_notif > sizeof *req ? sizes.seccomp_notif : sizeof *req);
    struct seccomp_notif_resp *resp =
        calloc(1, sizes.seccomp_notif_resp > sizeof *resp ? sizes.seccomp_notif_resp : sizeof *resp);
    char *target = malloc(PATH_MAX + 1), *linkpath = malloc(PATH_MAX + 1);
    if (!req || !resp || !target || !linkpath || ioctl(notify, SECCOMP_IOCTL_NOTIF_RECV, req) != 0) goto done;
    resp->id = req->id;
    int nr = req->data.nr, at_form = nr == 266 || nr == 0x4000010a || nr == 304 || nr == 36;
    unsigned long long target_at = req->data.args[0], link_at = at_form ? req->data.args[2] : req->data.args[1];
    int dirfd = at_form ? (int)req->data.args[1] : AT_FDCWD;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/mem", (int)req->pid);
    int mem = open(path, O_RDONLY | O_CLOEXEC), error = mem < 0 ? ESRCH : 0;
    if (!error) error = read_string(mem, target_at, target);
    if (!error) error = read_string(mem, link_at, linkpath);
    if (mem >= 0) close(mem);
    if (ioctl(notify, SECCOMP_IOCTL_NOTIF_ID_VALID, &req->id) != 0) goto done; /* the caller is gone */
    if (!error && judge_link(target)) error = EPERM;
    if (!error) error = make_link_as((pid_t)req->pid, dirfd, target, linkpath);
    resp->error = -error;
    ioctl(notify, SECCOMP_IOCTL_NOTIF_SEND, resp);
done:
    free(req);
    free(resp);
    free(target);
    free(linkpath);
}

/* Keeps only the capabilities in keep: bounding set, ambient set, then the process's own sets (a
 * command executed as root gets the bounding set, nothing more). 0 on success. */
static int drop_capabilities(unsigned long long keep) {
    for (int cap = 0; cap < 64; cap++)
        if (!(keep >> cap & 1) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL) return -1;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    data[0].effective = data[0].permitted = (uint32_t)(keep & 0xffffffffu);
    data[1].effective = data[1].permitted = (uint32_t)(keep >> 32);
    return (int)syscall(SYS_capset, &header, data);
}

/* A new procfs of this process's PID namespace, not attached yet (its descriptor, or -1). Made
 * while a /proc is still visible: the kernel lets a user namespace mount one only then. */
static int new_proc(void) {
    int fs = (int)syscall(SYS_fsopen, "proc", 0);
    if (fs < 0) return -1;
    int mnt = -1;
    if (syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE_, NULL, NULL, 0) == 0)
        mnt = (int)syscall(SYS_fsmount, fs, 0, MOUNT_ATTR_NOSUID_ | MOUNT_ATTR_NODEV_ | MOUNT_ATTR_NOEXEC_);
    close(fs);
    return mnt;
}

/* Makes /proc/N read-only ("ro:N") or masks it ("file:N": /dev/null over it; "dir:N": an empty
 * read-only tmpfs), for the entries that exist. 0 on success. */
static int harden_proc(void) {
    const unsigned long locked = MS_NOSUID | MS_NODEV | MS_NOEXEC;
    for (int i = 0; i < n_hardening; i++) {
        const char *item = hardening[i], *colon = strchr(item, ':');
        if (!colon || strncmp(item, "link-", 5) == 0 || strncmp(item, "cgroup-procs:", 13) == 0)
            continue; /* a flag ("links"), the link policy, the agent's cgroups */
        char path[300];
        snprintf(path, sizeof path, "/proc/%s", colon + 1);
        if (access(path, F_OK) != 0) continue;
        int rc = 0;
        if (strncmp(item, "ro:", 3) == 0) {
            rc = mount(path, path, NULL, MS_BIND | MS_REC, NULL) ||
                 mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | locked, NULL);
        } else if (strncmp(item, "file:", 5) == 0) {
            rc = mount("/dev/null", path, NULL, MS_BIND, NULL);
            if (rc == 0) mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, NULL);
        } else if (strncmp(item, "dir:", 4) == 0) {
            rc = mount("tmpfs", path, "tmpfs", MS_RDONLY | locked, "size=0,mode=0555");
        }
        if (rc) {
            dprintf(2, "supervisor: cannot harden %s: %s\n", path, strerror(errno));
            return -1;
        }
    }
    return 0;
}

/* Attaches the detached mount proc_fd at /proc, then hardens it. 0 on success. */
static int attach_proc(int proc_fd) {
    if (syscall(SYS_move_mount, proc_fd, "", AT_FDCWD, "/proc", MOVE_MOUNT_F_EMPTY_PATH_) != 0) return -1;
    close(proc_fd);
    return harden_proc();
}

/* What every supervisor sets up before it serves commands: rlimits, capabilities, no dumping. */
static int settle_for_commands(void) {
    if (as_limit) {
        struct rlimit rl = {as_limit, as_limit};
        setrlimit(RLIMIT_AS, &rl);
    }
    if (nproc_limit) {
        /* Without cgroups (not root), the sandbox's process limit: RLIMIT_NPROC counts the
         * processes of a uid in its own user namespace (a fork bomb gets EAGAIN); commands
         * cannot raise it. */
        struct rlimit rl = {nproc_limit, nproc_limit};
        setrlimit(RLIMIT_NPROC, &rl);
    }
    if (drop_capabilities(command_caps) != 0) {
        dprintf(2, "supervisor: cannot drop capabilities: %s\n", strerror(errno));
        return -1;
    }
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); /* inherited by handlers, reset by a command's execve */
    return 0;
}

/* The agent's supervisor, first process of a new PID and mount namespace: its own hardened /proc
 * (the keel's, with everything under it, detached), the link filter ("links"), then the commands'
 * limits and capabilities. */
static int agent_setup(int *filter) {
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return -1;
    int proc_fd = new_proc();
    if (proc_fd < 0) return -1;
    if (umount2("/proc", MNT_DETACH) != 0) return -1;
    if (attach_proc(proc_fd) != 0) return -1;
    *filter = mediate_links ? install_link_filter() : -1; /* while this process may still (CAP_SYS_ADMIN) */
    return settle_for_commands();
}

/* Brings the loopback interface of this network namespace up (as a new one starts it down). */
static int loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    struct ifreq req;
    memset(&req, 0, sizeof req);
    strncpy(req.ifr_name, "lo", IFNAMSIZ - 1);
    int rc = ioctl(s, SIOCGIFFLAGS, &req);
    if (rc == 0) {
        req.ifr_flags |= IFF_UP | IFF_RUNNING;
        rc = ioctl(s, SIOCSIFFLAGS, &req);
    }
    close(s);
    return rc;
}

/* A verifier's supervisor, just forked with its own mount, network, IPC and UTS namespaces: the
 * host's tree as its root (the keel's old root detached), its own /proc (the keel's PID
 * namespace), the keel's /dev with a /dev/shm and /dev/pts of its own, loopback up. */
static void watch_commands(void);

static int view_setup(int tree, const char *hostname, int *binds) {
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return -1;
    int proc_fd = new_proc();
    int dev_fd = (int)syscall(SYS_open_tree, AT_FDCWD, "/dev", OPEN_TREE_CLONE_ | AT_RECURSIVE_ | O_CLOEXEC);
    if (proc_fd < 0 || dev_fd < 0) return -1;
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, "/", MOVE_MOUNT_F_EMPTY_PATH_) != 0) return -1;
    if (fchdir(tree) != 0 || syscall(SYS_pivot_root, ".", ".") != 0) return -1;
    if (umount2(".", MNT_DETACH) != 0 || chdir("/") != 0) return -1;
    close(tree);
    if (syscall(SYS_move_mount, dev_fd, "", AT_FDCWD, "/dev", MOVE_MOUNT_F_EMPTY_PATH_) != 0) return -1;
    close(dev_fd);
    if (mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=67108864") != 0) return -1;
    if (mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620") != 0 &&
        errno != ENOENT)
        return -1;
    if (attach_proc(proc_fd) != 0) return -1;
    if (loopback_up() != 0) return -1;
    if (sethostname(hostname, strlen(hostname)) != 0) return -1;
    watch_commands(); /* while this process may still install filters (CAP_SYS_ADMIN) */
    if (binds) *binds = install_bind_filter();
    return settle_for_commands();
}

/* The verifier's commands on PATH, once installed, are the ones that run (issue #43, class 5).
 *
 * The view shows the commands the agent added to the image's PATH folders under new names (what it
 * installed: the tests may run them). A command the verifier installs while it runs (apt-get, pip,
 * a copy) may land in a later PATH folder than one of the agent's of the same name, which the shell
 * would find first: the agent's code would run as the verifier's tool. The view lists the PATH
 * folders ("W" records) and the agent's added commands ("A" records, whole paths) in COMMANDS_FILE;
 * a watcher forked here removes the agent's command from the view (a whiteout in the view's own
 * layer: the agent's sandbox keeps it) once a command of that name is made in another PATH folder.
 *
 * It does so before the call that makes it returns: every call of the verifier's processes that can
 * give a file a name (open and openat with O_CREAT, creat, openat2, rename*, link*, symlink*, mknod*)
 * stops at a seccomp filter (installed on the view's supervisor, inherited by all it starts) whose
 * listener is the watcher; it reads the new name from the caller's memory, gives way when the name
 * is an added command's and its folder a PATH folder, and lets the call go on. An install followed
 * at once by the command's name finds the verifier's: no window (an inotify watch alone left one,
 * seen in CI). The watch stays for what the filter cannot see (a caller whose memory the watcher may
 * not read, io_uring); an overflowed event queue is answered by a sweep of every name. The watcher
 * only reads and unlinks: it makes no name (it would wait on itself). Honest callers' paths are what
 * is read; a verifier racing its own memory could only keep the agent's command it runs. */
static int came(int fd);

#ifndef SECCOMP_USER_NOTIF_FLAG_CONTINUE
#define SECCOMP_USER_NOTIF_FLAG_CONTINUE (1UL << 0)
#endif

/* A call that gives a file a name: its number, the argument holding the new name, the one holding
 * the folder descriptor it is relative to (-1: the working directory), and the one holding the
 * open flags (-1: it always makes a name; else only with O_CREAT). One table for the filter and for
 * the watcher's reading of a call. */
struct naming_call {
    int nr, name_arg, dir_arg, flags_arg;
};
#if defined(__x86_64__)
#define NAMING_ARCH AUDIT_ARCH_X86_64
static const struct naming_call naming_calls[] = {
    {2, 0, -1, 1},    /* open */
    {257, 1, 0, 2},   /* openat */
    {85, 0, -1, -1},  /* creat */
    {437, 1, 0, -1},  /* openat2 (its flags are in a struct the filter cannot read) */
    {82, 1, -1, -1},  /* rename */
    {264, 3, 2, -1},  /* renameat */
    {316, 3, 2, -1},  /* renameat2 */
    {86, 1, -1, -1},  /* link */
    {265, 3, 2, -1},  /* linkat */
    {88, 1, -1, -1},  /* symlink */
    {266, 2, 1, -1},  /* symlinkat */
    {133, 0, -1, -1}, /* mknod */
    {259, 1, 0, -1},  /* mknodat */
};
#elif defined(__aarch64__)
#define NAMING_ARCH AUDIT_ARCH_AARCH64
static const struct naming_call naming_calls[] = {
    {56, 1, 0, 2},   /* openat */
    {437, 1, 0, -1}, /* openat2 */
    {38, 3, 2, -1},  /* renameat */
    {276, 3, 2, -1}, /* renameat2 */
    {37, 3, 2, -1},  /* linkat */
    {36, 2, 1, -1},  /* symlinkat */
    {33, 1, 0, -1},  /* mknodat */
};
#endif

/* Installs the naming filter on this process (inherited by all it starts); its listener, or -1
 * where the kernel or the architecture cannot (then the watch alone gives way). */
static int install_naming_filter(void) {
#if defined(NAMING_ARCH)
    enum { N = sizeof naming_calls / sizeof naming_calls[0] };
    struct sock_filter code[4 + 5 * N + 1];
    unsigned n = 0;
    code[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
    code[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NAMING_ARCH, 1, 0);
    code[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    code[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
    for (unsigned i = 0; i < N; i++) {
        const struct naming_call *call = &naming_calls[i];
        if (call->flags_arg < 0) { /* this call: notify; another: the next test */
            code[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)call->nr, 0, 1);
            code[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF);
        } else { /* this call: notify with O_CREAT (the flags' low word), allow without */
            code[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)call->nr, 0, 4);
            code[n++] = (struct sock_filter)BPF_STMT(
                BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args) + 8u * (unsigned)call->flags_arg);
            code[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, O_CREAT, 0, 1);
            code[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF);
            code[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
        }
    }
    code[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    struct sock_fprog program = {(unsigned short)n, code};
    long fd = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &program);
    return fd < 0 ? -1 : (int)fd;
#else
    return -1;
#endif
}
#define COMMANDS_FILE "/.harbor-local-sandbox/commands"
#define COMMANDS_CAP (16u << 20)

struct folder_id {
    dev_t dev;
    ino_t ino;
};

struct added_command {
    const char *path, *name;
    struct folder_id folder;
    int gone;
};

static int same_folder(struct folder_id a, struct folder_id b) { return a.dev == b.dev && a.ino == b.ino; }

static int folder_of(const char *path, struct folder_id *id) {
    struct stat info;
    if (stat(path, &info) != 0 || !S_ISDIR(info.st_mode)) return -1;
    id->dev = info.st_dev;
    id->ino = info.st_ino;
    return 0;
}

static int by_name(const void *a, const void *b) {
    return strcmp(((const struct added_command *)a)->name, ((const struct added_command *)b)->name);
}

/* Removes the agent's commands named name that are not in the folder where the verifier's appeared. */
static void give_way(struct added_command *added, size_t n, const char *name, struct folder_id where) {
    struct added_command key = {NULL, name, {0, 0}, 0};
    struct added_command *hit = bsearch(&key, added, n, sizeof *added, by_name);
    if (!hit) return;
    while (hit > added && strcmp(hit[-1].name, name) == 0) hit--;
    for (; hit < added + n && strcmp(hit->name, name) == 0; hit++)
        if (!hit->gone && !same_folder(hit->folder, where) && (unlink(hit->path) == 0 || errno == ENOENT))
            hit->gone = 1;
}

/* The folder a name made by process pid is in (path as the call has it, relative to dirfd), seen
 * through the caller's root or working directory; 0, or -1 when it is not there. */
static int naming_folder(pid_t pid, int dirfd, const char *path, const char *slash, struct folder_id *id) {
    char folder[PATH_MAX + 64];
    int len = slash ? (int)(slash - path) : 0, wrote;
    if (path[0] == '/') wrote = snprintf(folder, sizeof folder, "/proc/%d/root%.*s/", (int)pid, len, path);
    else if (dirfd == AT_FDCWD) wrote = snprintf(folder, sizeof folder, "/proc/%d/cwd/%.*s", (int)pid, len, path);
    else wrote = snprintf(folder, sizeof folder, "/proc/%d/fd/%d/%.*s", (int)pid, dirfd, len, path);
    return wrote < (int)sizeof folder ? folder_of(folder, id) : -1;
}

/* Reads a NUL-terminated string of at most PATH_MAX bytes at address in process pid, a page at a
 * time (process_vm_readv: one call for most paths, no file opened); 0, or an errno. */
static int read_remote_string(pid_t pid, unsigned long long address, char *out) {
    size_t got = 0;
    while (got < PATH_MAX + 1) {
        unsigned long long at = address + got;
        size_t want = 4096 - (size_t)(at & 4095); /* to the end of its page: a later page may be unmapped */
        if (want > PATH_MAX + 1 - got) want = PATH_MAX + 1 - got;
        struct iovec local = {out + got, want}, remote = {(void *)(uintptr_t)at, want};
        ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
        if (n <= 0) return n < 0 ? errno : EFAULT;
        if (memchr(out + got, 0, (size_t)n)) return 0;
        got += (size_t)n;
    }
    return ENAMETOOLONG;
}

/* The buffers of one naming notification (sized as the kernel says). */
struct naming_request {
    struct seccomp_notif *req;
    struct seccomp_notif_resp *resp;
    size_t req_size, resp_size;
    char *path;
};

/* Answers one notification of the naming filter: gives way when the call names an added command in
 * a PATH folder other than its own, then lets the call go on (whatever it was). */
static void answer_naming(int notify, struct naming_request *r, struct added_command *added, size_t n_added,
                          const struct folder_id *watched, size_t n_watched) {
#if defined(NAMING_ARCH)
    memset(r->req, 0, r->req_size);
    if (ioctl(notify, SECCOMP_IOCTL_NOTIF_RECV, r->req) != 0) return;
    const struct naming_call *call = NULL;
    for (size_t i = 0; i < sizeof naming_calls / sizeof naming_calls[0]; i++)
        if (naming_calls[i].nr == r->req->data.nr) call = &naming_calls[i];
    if (call && r->req->data.arch == NAMING_ARCH &&
        read_remote_string((pid_t)r->req->pid, r->req->data.args[call->name_arg], r->path) == 0 &&
        ioctl(notify, SECCOMP_IOCTL_NOTIF_ID_VALID, &r->req->id) == 0) { /* the path is the caller's */
        char *slash = strrchr(r->path, '/');
        const char *name = slash ? slash + 1 : r->path;
        struct added_command key = {NULL, name, {0, 0}, 0};
        struct folder_id where;
        int dirfd = call->dir_arg < 0 ? AT_FDCWD : (int)r->req->data.args[call->dir_arg];
        if (*name && bsearch(&key, added, n_added, sizeof *added, by_name) &&
            naming_folder((pid_t)r->req->pid, dirfd, r->path, slash, &where) == 0)
            for (size_t j = 0; j < n_watched; j++)
                if (same_folder(watched[j], where)) {
                    give_way(added, n_added, name, where);
                    break;
                }
    }
    memset(r->resp, 0, r->resp_size);
    r->resp->id = r->req->id;
    r->resp->flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
    ioctl(notify, SECCOMP_IOCTL_NOTIF_SEND, r->resp);
#else
    (void)notify, (void)r, (void)added, (void)n_added, (void)watched, (void)n_watched;
#endif
}

static void watch_commands_forever(char *records, size_t size, int ready, int notify) {
    size_t n_added = 0, n_watched = 0;
    for (size_t i = 0; i < size; i += strlen(records + i) + 1) {
        if (records[i] == 'A') n_added++;
        if (records[i] == 'W') n_watched++;
    }
    struct added_command *added = calloc(n_added + 1, sizeof *added);
    int *wds = calloc(n_watched + 1, sizeof *wds);
    struct folder_id *watched = calloc(n_watched + 1, sizeof *watched);
    const char **watched_path = calloc(n_watched + 1, sizeof *watched_path);
    int in = inotify_init1(IN_CLOEXEC);
    if (!added || !wds || !watched || !watched_path || in < 0) _exit(1);
    size_t a = 0, w = 0;
    for (size_t i = 0; i < size; i += strlen(records + i) + 1) {
        char *record = records + i;
        if (record[0] == 'W' && folder_of(record + 1, &watched[w]) == 0) {
            wds[w] = inotify_add_watch(in, record + 1, IN_CREATE | IN_MOVED_TO | IN_ONLYDIR);
            watched_path[w] = record + 1;
            if (wds[w] >= 0) w++;
        } else if (record[0] == 'A') {
            char *slash = strrchr(record, '/');
            if (!slash || slash == record + 1 || !slash[1]) continue;
            *slash = 0;
            int known = folder_of(record + 1, &added[a].folder) == 0;
            *slash = '/';
            if (!known) continue;
            added[a].path = record + 1;
            added[a].name = slash + 1;
            a++;
        }
    }
    n_added = a;
    n_watched = w;
    qsort(added, n_added, sizeof *added, by_name);
    write_full(ready, "", 1); /* the view serves once its PATH folders are watched */
    close(ready);
    int sweep = 0;
    static char events[64 * 1024] __attribute__((aligned(__alignof__(struct inotify_event))));
    struct naming_request naming = {0};
    struct seccomp_notif_sizes sizes;
    if (notify >= 0 && syscall(SYS_seccomp, SECCOMP_GET_NOTIF_SIZES, 0, &sizes) == 0) {
        naming.req_size = sizes.seccomp_notif > sizeof *naming.req ? sizes.seccomp_notif : sizeof *naming.req;
        naming.resp_size =
            sizes.seccomp_notif_resp > sizeof *naming.resp ? sizes.seccomp_notif_resp : sizeof *naming.resp;
        naming.req = calloc(1, naming.req_size);
        naming.resp = calloc(1, naming.resp_size);
        naming.path = malloc(PATH_MAX + 1);
        if (!naming.req || !naming.resp || !naming.path) _exit(1); /* the callers are let go (ENOSYS) */
    }
    for (;;) {
        if (sweep) {
            for (size_t i = 0; i < n_added; i++) {
                struct stat info;
                for (size_t j = 0; j < n_watched && !added[i].gone; j++) {
                    char path[PATH_MAX];
                    if (same_folder(watched[j], added[i].folder)) continue;
                    if (snprintf(path, sizeof path, "%s/%s", watched_path[j], added[i].name) >= (int)sizeof path)
                        continue;
                    if (lstat(path, &info) == 0) give_way(added, n_added, added[i].name, watched[j]);
                }
            }
            sweep = 0;
        }
        struct pollfd polled[2] = {{in, POLLIN, 0}, {notify, POLLIN, 0}};
        if (poll(polled, notify >= 0 ? 2 : 1, -1) < 0) {
            if (errno == EINTR) continue;
            _exit(1);
        }
        if (notify >= 0 && polled[1].revents & POLLIN)
            answer_naming(notify, &naming, added, n_added, watched, n_watched);
        else if (notify >= 0 && polled[1].revents & (POLLHUP | POLLERR | POLLNVAL)) {
            close(notify); /* no process of the view's is left to ask */
            notify = -1;
        }
        if (!(polled[0].revents & POLLIN)) continue;
        ssize_t len = read(in, events, sizeof events);
        if (len < 0) {
            if (errno == EINTR) continue;
            _exit(1);
        }
        for (char *p = events; p < events + len;) {
            struct inotify_event *event = (struct inotify_event *)p;
            p += sizeof *event + event->len;
            if (event->mask & IN_Q_OVERFLOW) sweep = 1;
            if (!event->len) continue;
            for (size_t j = 0; j < n_watched; j++)
                if (wds[j] == event->wd) {
                    give_way(added, n_added, event->name, watched[j]);
                    break;
                }
        }
    }
}

/* Forks the watcher of the view's PATH folders when the view lists commands the agent added there,
 * then installs the naming filter on this process and hands its listener to the watcher. Called
 * while this process may still install filters; the watcher keeps the commands' capabilities and
 * CAP_SYS_PTRACE (to read a caller's memory), and is forked before the filter (it is not under it). */
static void watch_commands(void) {
    int fd = open(COMMANDS_FILE, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return;
    struct stat info;
    char *records = NULL;
    if (fstat(fd, &info) == 0 && S_ISREG(info.st_mode) && info.st_size > 0 && info.st_size <= COMMANDS_CAP &&
        (records = malloc((size_t)info.st_size + 1)) && read_full(fd, records, (size_t)info.st_size) == 0) {
        records[info.st_size] = 0;
        pid_t parent = getpid();
        int ready[2], handover[2];
        if (pipe2(ready, O_CLOEXEC) == 0) {
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, handover) != 0) handover[0] = handover[1] = -1;
            pid_t pid = fork();
            if (pid == 0) {
                close(ready[0]);
                prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
                if (getppid() != parent) _exit(0);
                int notify = -1;
                if (handover[0] >= 0) {
                    close(handover[0]);
                    /* a byte: it can serve the filter (the filter is installed only then) */
                    if (drop_capabilities(command_caps | 1ULL << CAP_SYS_PTRACE) == 0 &&
                        write_full(handover[1], "", 1) == 0)
                        notify = receive_fd(handover[1]);
                    close(handover[1]);
                }
                prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
                watch_commands_forever(records, (size_t)info.st_size, ready[1], notify);
            }
            close(ready[1]);
            if (handover[0] >= 0) {
                close(handover[1]);
                struct pollfd polled = {handover[0], POLLIN, 0};
                char byte;
                int serves = pid > 0 && poll(&polled, 1, 5000) == 1 && read(handover[0], &byte, 1) == 1;
                int notify = serves ? install_naming_filter() : -1;
                if (serves) send_fd(handover[0], notify);
                if (notify >= 0) close(notify);
                close(handover[0]);
            }
            came(pid > 0 ? ready[0] : (close(ready[0]), -1));
        }
    }
    free(records);
    close(fd);
}

/* A request: its timeout, output cap, fields (NULL-terminated) and descriptors. */
struct request {
    uint32_t timeout_ms, cap, nfields;
    char **fields;
    int fds[MAX_FDS], nfds;
};

static void request_free(struct request *r) {
    for (uint32_t i = 0; i < r->nfields; i++) free(r->fields[i]);
    free(r->fields);
    for (int i = 0; i < r->nfds; i++) close(r->fds[i]);
    r->nfds = 0;
}

/* Reads the request's size, with the descriptors that came with it (SCM_RIGHTS). 0 on success. */
static int read_head(int conn, uint32_t *size, struct request *r) {
    char control[CMSG_SPACE(MAX_FDS * sizeof(int))];
    struct iovec iov = {size, 4};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n;
    do n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC); while (n < 0 && errno == EINTR);
    if (n <= 0) return -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < count; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            if (r->nfds < MAX_FDS) r->fds[r->nfds++] = fd;
            else close(fd);
        }
    }
    return n == 4 ? 0 : read_full(conn, (char *)size + n, 4 - (size_t)n);
}

/* Reads one request. 0 on success. */
static int read_request(int conn, struct request *r) {
    memset(r, 0, sizeof *r);
    uint32_t size;
    if (read_head(conn, &size, r) || size < 12 || size > MAX_REQUEST) return -1;
    char *req = malloc(size + 1);
    if (read_full(conn, req, size)) {
        free(req);
        return -1;
    }
    const char *p = req, *end = req + size;
    r->timeout_ms = get_u32(&p);
    r->cap = get_u32(&p);
    uint32_t nfields = get_u32(&p);
    if (r->cap < 64) r->cap = 64;
    char **fields = calloc(nfields + 1, sizeof *fields);
    int bad = nfields < 2;
    for (uint32_t i = 0; i < nfields && !bad; i++) {
        if (end - p < 4) {
            bad = 1;
            break;
        }
        uint32_t len = get_u32(&p);
        if ((uint32_t)(end - p) < len) {
            bad = 1;
            break;
        }
        fields[i] = malloc(len + 1);
        memcpy(fields[i], p, len);
        fields[i][len] = 0;
        p += len;
    }
    free(req);
    r->fields = fields;
    r->nfields = nfields;
    if (bad) {
        request_free(r);
        return -1;
    }
    return 0;
}

static void serve(int listener);

/* Starts the forwarder (the program exe) between this namespace's network (the agent's) and that of
 * the verifier's supervisor view_pid, with a pidfd of it (it exits with it) and the listener of the
 * verifier's bind filter (binds, or -1): the read end of a pipe it writes one byte to once it serves
 * the agent's ports, or -1. */
static int spawn_forwarder(int exe, pid_t view_pid, int binds) {
    char path[300];
    snprintf(path, sizeof path, "/proc/%d/ns/net", (int)view_pid);
    int agent_net = open("/proc/self/ns/net", O_RDONLY), view_net = open(path, O_RDONLY);
    int watched = (int)syscall(SYS_pidfd_open, view_pid, 0), ready[2] = {-1, -1};
    pid_t pid = -1;
    if (agent_net >= 0 && view_net >= 0 && watched >= 0 && pipe2(ready, O_CLOEXEC) == 0) pid = fork();
    if (pid == 0) {
        setsid();
        char a[16], v[16], w[16], b[16];
        snprintf(a, sizeof a, "%d", agent_net);
        snprintf(v, sizeof v, "%d", view_net);
        snprintf(w, sizeof w, "%d", watched);
        snprintf(b, sizeof b, "%d", binds);
        char *argv[] = {"forwarder", a, v, w, binds >= 0 ? b : NULL, NULL}, *envp[] = {NULL};
        if (binds >= 0) fcntl(binds, F_SETFD, 0);
        int devnull = open("/dev/null", O_RDWR);
        dup2(devnull, 0);
        dup2(ready[1], 1);
        dup2(devnull, 2);
        fcntl(agent_net, F_SETFD, 0);
        fcntl(view_net, F_SETFD, 0);
        fcntl(watched, F_SETFD, 0);
        fexecve(exe, argv, envp);
        _exit(127);
    }
    int opened[] = {agent_net, view_net, watched, ready[1]};
    for (int i = 0; i < 4; i++)
        if (opened[i] >= 0) close(opened[i]);
    if (pid < 0 && ready[0] >= 0) {
        close(ready[0]);
        return -1;
    }
    return ready[0];
}

/* Waits (5 s at most) for the byte a starting process writes on fd; 1 if it came. Closes fd. */
static int came(int fd) {
    if (fd < 0) return 0;
    struct pollfd polled = {fd, POLLIN, 0};
    char byte;
    int ok = poll(&polled, 1, 5000) == 1 && read(fd, &byte, 1) == 1;
    close(fd);
    return ok;
}

/* "view HOST" (descriptors: the root tree, the listening socket, and the forwarder, optional): forks
 * the verifier's supervisor and its forwarder, and answers its PID once both serve. */
static void start_view(int conn, struct request *r) {
    if (r->nfields < 3 || r->nfds < 2) {
        answer_control(conn, -1, "", 0);
        return;
    }
    int ready[2], forward = r->nfds > 2;
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ready) != 0) {
        answer_control(conn, -1, "", 0);
        return;
    }
    pid_t pid = (pid_t)syscall(SYS_clone, CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) {
        close(ready[0]);
        close(conn);
        role = VIEW;
        int binds = -1;
        if (view_setup(r->fds[0], r->fields[2], forward ? &binds : NULL) != 0) {
            dprintf(ready[1], "cannot make the verifier's namespaces: %s", strerror(errno));
            _exit(1);
        }
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
        signal(SIGCHLD, SIG_IGN);
        /* Listening from here makes this process the peer every connect() sees: the host learns its
         * PID, in the host's own namespace, with SO_PEERCRED (this handler exits, the view is reparented). */
        if (listen(r->fds[1], 128) != 0) {
            dprintf(ready[1], "cannot listen for the verifier's commands: %s", strerror(errno));
            _exit(1);
        }
        send_fd(ready[1], binds); /* a zero byte: ready */
        if (binds >= 0) close(binds);
        close(ready[1]);
        serve(r->fds[1]);
        _exit(0);
    }
    close(ready[1]);
    char why[512] = "";
    ssize_t n = -1;
    int binds = -1, byte = -1;
    if (pid > 0) /* a zero byte (with the bind filter's listener): ready; else an error message */
        binds = receive_byte_fd(ready[0], &byte);
    if (byte == 0) {
        n = 1;
    } else if (byte > 0) {
        why[0] = (char)byte;
        ssize_t more = read(ready[0], why + 1, sizeof why - 2);
        n = 1 + (more > 0 ? more : 0);
        why[n] = 0;
    }
    close(ready[0]);
    if (forward && n == 1 && why[0] == 0) {
        int started = came(spawn_forwarder(r->fds[2], pid, binds));
        if (!started) snprintf(why, sizeof why, "the forwarder of the agent's ports did not start");
        n = started ? 1 : (ssize_t)strlen(why);
    }
    if (binds >= 0) close(binds);
    if (n == 1 && why[0] == 0) {
        char text[32];
        int len = snprintf(text, sizeof text, "%d", (int)pid);
        answer_control(conn, 0, text, (size_t)len);
    } else {
        if (n > 0) why[n] = 0;
        answer_control(conn, -2, why, strlen(why));
    }
}

/* Answers a control request (an empty cwd marks one); returns 0 if the request is a command. */
static int serve_control(int conn, struct request *r) {
    char **fields = r->fields;
    if (fields[0][0] != 0) return 0;
    if (strcmp(fields[1], "ps") == 0) {
        char *text;
        size_t len = list_processes(&text);
        answer_control(conn, 0, text, len);
    } else if (strcmp(fields[1], "kill") == 0) {
        answer_control(conn, kill_selected(agents_filter, NULL, fields + 2, r->nfields - 2), "", 0);
    } else if (role == KEEL && strcmp(fields[1], "view") == 0) {
        start_view(conn, r);
    } else if (role == KEEL && strcmp(fields[1], "unview") == 0 && r->nfields > 2) {
        unsigned long long net = net_inode(fields[2]);
        int killed = net ? kill_selected(in_net_filter, &net, NULL, 0) : 0;
        answer_control(conn, killed, "", 0);
    } else {
        answer_control(conn, -1, "", 0);
    }
    return 1;
}

/* No handler could be forked (the sandbox is at its process limit): control requests are still
 * served, here (a "kill" is how the host frees the sandbox); commands get the reason. */
static void serve_unforked(int conn, int error) {
    struct request r;
    if (read_request(conn, &r)) {
        close(conn);
        return;
    }
    if (!serve_control(conn, &r)) answer_failure(conn, 126, "fork", error);
    request_free(&r);
}

static void handle(int conn) {
    signal(SIGCHLD, SIG_DFL);
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);

    struct request r;
    if (read_request(conn, &r)) return;
    if (serve_control(conn, &r)) return;
    uint32_t timeout_ms = r.timeout_ms, cap = r.cap;
    for (int i = 0; i < r.nfds; i++) close(r.fds[i]); /* a command takes no descriptor */
    r.nfds = 0;
    const char *cwd = r.fields[0], *cmd = r.fields[1];
    char **envp = r.fields + 2; /* NULL-terminated by calloc */

    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC)) {
        answer_failure(conn, 126, "pipe", errno);
        return;
    }
    pid_t pid = fork();
    if (pid < 0) {
        answer_failure(conn, 126, "fork", errno);
        return;
    }
    if (pid == 0) {
        setsid();
        signal(SIGPIPE, SIG_DFL); /* ignored dispositions survive execve */
        int devnull = open("/dev/null", O_RDONLY);
        dup2(devnull, 0);
        dup2(out[1], 1);
        dup2(err[1], 2);
        /* Nothing of the host reaches a command: no descriptor but its standard streams (the
         * supervisor's own binary is open in PID 1, bubblewrap may leave others). */
        if (syscall(SYS_close_range, 3, ~0U, 0) != 0)
            for (int fd = 3; fd < 65536; fd++) close(fd);
        if (chdir(cwd) != 0) {
            dprintf(2, "cannot enter working directory %s: %s\n", cwd, strerror(errno));
            _exit(126);
        }
        const char *shell = access("/bin/bash", X_OK) == 0 ? "/bin/bash" : "/bin/sh";
        char *argv[] = {(char *)shell, "-c", (char *)cmd, NULL};
        execve(shell, argv, envp);
        dprintf(2, "cannot start %s: %s\n", shell, strerror(errno));
        _exit(127);
    }
    close(out[1]);
    close(err[1]);
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);

    struct bounded streams[2];
    bounded_init(&streams[0], cap);
    bounded_init(&streams[1], cap);
    int fds[2] = {out[0], err[0]};
    int open_fds = 2, status = -1, exited = 0, timed_out = 0;
    int64_t deadline = timeout_ms ? now_ms() + timeout_ms : -1, exited_at = 0;
    char buf[65536];
    for (;;) {
        if (exited && (open_fds == 0 || now_ms() - exited_at > DRAIN_GRACE_MS)) break;
        int wait_ms = 500;
        if (deadline >= 0 && !exited) {
            int64_t left = deadline - now_ms();
            wait_ms = left < 0 ? 0 : (left < wait_ms ? (int)left : wait_ms);
        }
        if (exited) {
            int64_t left = exited_at + DRAIN_GRACE_MS - now_ms();
            wait_ms = left < 0 ? 0 : (int)left;
        }
        struct pollfd polled[4];
        int np = 0, index_of[4];
        for (int i = 0; i < 2; i++)
            if (fds[i] >= 0) {
                polled[np] = (struct pollfd){fds[i], POLLIN, 0};
                index_of[np++] = i;
            }
        polled[np] = (struct pollfd){conn, POLLIN | POLLRDHUP, 0};
        index_of[np++] = 2;
        if (!exited && pidfd >= 0) {
            polled[np] = (struct pollfd){pidfd, POLLIN, 0};
            index_of[np++] = 3;
        }
        int ready = poll(polled, np, wait_ms);
        if (ready < 0 && errno != EINTR) break;
        if (!exited && pidfd < 0) { /* kernels without pidfd: poll the child */
            int raw;
            if (waitpid(pid, &raw, WNOHANG) == pid) {
                status = raw;
                exited = 1;
                exited_at = now_ms();
            }
        }
        for (int k = 0; ready > 0 && k < np; k++) {
            if (!polled[k].revents) continue;
            int which = index_of[k];
            if (which == 3) {
                int raw;
                if (waitpid(pid, &raw, 0) == pid) status = raw;
                exited = 1;
                exited_at = now_ms();
            } else if (which == 2) {
                /* The host never sends more than the request: readable means it
                 * hung up (a cancelled exec). */
                kill_tree();
                _exit(0);
            } else {
                ssize_t n = read(fds[which], buf, sizeof buf);
                if (n > 0) {
                    bounded_add(&streams[which], buf, (size_t)n);
                    if (exited) exited_at = now_ms();
                } else if (n == 0 || errno != EINTR) {
                    close(fds[which]);
                    fds[which] = -1;
                    open_fds--;
                }
            }
        }
        if (!exited && deadline >= 0 && now_ms() >= deadline) {
            timed_out = 1;
            kill_tree();
            break;
        }
    }
    int32_t rc;
    if (!exited || status == -1)
        rc = 128 + SIGKILL;
    else if (WIFEXITED(status))
        rc = WEXITSTATUS(status);
    else
        rc = 128 + WTERMSIG(status);
    uint32_t flags = timed_out ? 1 : 0;
    if (!write_full(conn, &rc, 4) && !write_full(conn, &flags, 4) && !bounded_send(conn, &streams[0]))
        bounded_send(conn, &streams[1]);
    close(conn);
    for (int i = 0; i < 2; i++)
        if (fds[i] >= 0) close(fds[i]);
    /* Stay alive as the subreaper of whatever the command left running. */
    for (;;) {
        if (wait(NULL) < 0 && errno != EINTR) break;
    }
}


/* Accepts one connection, served by a forked handler. */
static void accept_one(int listener) {
    int conn = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
    if (conn < 0) {
        if (errno == EINTR || errno == ECONNABORTED || errno == EAGAIN) return;
        _exit(1);
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(listener);
        handle(conn);
        _exit(0);
    }
    if (pid < 0) { /* no handler: serve it from here (it is short) and go on */
        serve_unforked(conn, errno);
        return;
    }
    close(conn);
}

/* Accepts connections forever (the agent's and the verifier's supervisors). */
static void serve(int listener) {
    fcntl(listener, F_SETFD, FD_CLOEXEC);
    for (;;) accept_one(listener);
}

/* The keel's loop: control connections, and the agent's links (notify: the link filter's listener). */
static void serve_keel(int listener, int notify) {
    fcntl(listener, F_SETFD, FD_CLOEXEC);
    for (;;) {
        struct pollfd polled[2] = {{listener, POLLIN, 0}, {notify, POLLIN, 0}};
        if (poll(polled, notify >= 0 ? 2 : 1, -1) < 0) {
            if (errno == EINTR) continue;
            _exit(1);
        }
        if (notify >= 0 && (polled[1].revents & POLLIN)) answer_link_request(notify);
        if (notify >= 0 && (polled[1].revents & (POLLHUP | POLLERR | POLLNVAL))) { /* no agent process is left */
            close(notify);
            notify = -1;
        }
        if (polled[0].revents & POLLIN) accept_one(listener);
    }
}

/* "judge-link ITEM...": the link policy's verdict (0, 1, 2) for each target read from standard input, a
 * line each, as the keel would judge it (the tests compare it with _links.py's). */
static int judge_links_main(int argc, char **argv) {
    read_link_policy(argv + 2, argc - 2);
    char *line = NULL;
    size_t size = 0;
    ssize_t n;
    while ((n = getline(&line, &size, stdin)) > 0) {
        if (line[n - 1] == '\n') line[n - 1] = 0;
        printf("%d\n", judge_link(line));
    }
    free(line);
    return 0;
}

/* user.max_user_namespaces = 0 in the sandbox's user namespace, then CAP_SYS_RESOURCE (the only
 * way to raise it again) given up. bubblewrap may have made /proc/sys read-only: then through a
 * procfs of this process's own. 0 on success. */
static int forbid_user_namespaces(void) {
    int knob = open("/proc/sys/user/max_user_namespaces", O_WRONLY | O_CLOEXEC);
    if (knob < 0 && (errno == EROFS || errno == EACCES)) {
        int proc = new_proc();
        if (proc >= 0) {
            knob = openat(proc, "sys/user/max_user_namespaces", O_WRONLY | O_CLOEXEC);
            close(proc);
        }
    }
    if (knob < 0) return -1;
    int written = write(knob, "0\n", 2) == 2;
    close(knob);
    if (!written) return -1;
    if (prctl(PR_CAPBSET_DROP, CAP_SYS_RESOURCE, 0, 0, 0) != 0 && errno != EINVAL) return -1;
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &header, data) != 0) return -1;
    data[CAP_SYS_RESOURCE / 32].effective &= ~(1u << (CAP_SYS_RESOURCE % 32));
    data[CAP_SYS_RESOURCE / 32].permitted &= ~(1u << (CAP_SYS_RESOURCE % 32));
    data[CAP_SYS_RESOURCE / 32].inheritable &= ~(1u << (CAP_SYS_RESOURCE % 32));
    return (int)syscall(SYS_capset, &header, data);
}

#define MAX_CGROUP_FDS 8

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "judge-link") == 0) return judge_links_main(argc, argv);
    if (argc < 6) return 2;
    int control = atoi(argv[1]), agent = atoi(argv[2]);
    as_limit = strtoull(argv[3], NULL, 10);
    nproc_limit = strtoull(argv[4], NULL, 10);
    command_caps = strtoull(argv[5], NULL, 16);
    hardening = argv + 6;
    n_hardening = argc - 6;
    int cgroup_fds[MAX_CGROUP_FDS], n_cgroup_fds = 0;
    for (int i = 0; i < n_hardening; i++) {
        mediate_links |= strcmp(hardening[i], "links") == 0;
        if (strncmp(hardening[i], "cgroup-procs:", 13) == 0 && n_cgroup_fds < MAX_CGROUP_FDS) {
            cgroup_fds[n_cgroup_fds] = atoi(hardening[i] + 13);
            fcntl(cgroup_fds[n_cgroup_fds++], F_SETFD, FD_CLOEXEC);
        }
    }
    read_link_policy(hardening, n_hardening);
    fcntl(control, F_SETFD, FD_CLOEXEC);
    fcntl(agent, F_SETFD, FD_CLOEXEC);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    signal(SIGPIPE, SIG_IGN);
    if (forbid_user_namespaces() != 0) {
        dprintf(2, "supervisor: cannot forbid nested user namespaces: %s\n", strerror(errno));
        return 1;
    }
    int ready[2], links[2];
    if (pipe2(ready, O_CLOEXEC) != 0 || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, links) != 0) return 1;
    /* The agent's supervisor: the first process of its PID namespace, nested in this one. */
    pid_t pid = (pid_t)syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) {
        for (int i = 0; i < n_cgroup_fds; i++) close(cgroup_fds[i]);
        close(ready[0]);
        close(control);
        close(links[0]);
        role = AGENT;
        int filter = -1;
        if (agent_setup(&filter) != 0) {
            dprintf(2, "supervisor: cannot make the agent's namespaces: %s\n", strerror(errno));
            _exit(1);
        }
        send_fd(links[1], filter);
        if (filter >= 0) close(filter);
        close(links[1]);
        signal(SIGCHLD, SIG_IGN); /* handlers and orphans are reaped by the kernel */
        if (write_full(ready[1], "", 1)) _exit(1);
        close(ready[1]);
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        close(devnull);
        serve(agent);
    }
    close(ready[1]);
    close(agent);
    close(links[1]);
    int moved = 1;
    char number[16];
    snprintf(number, sizeof number, "%d", (int)pid);
    for (int i = 0; i < n_cgroup_fds; i++) {
        if (pid > 0 && moved && write(cgroup_fds[i], number, strlen(number)) < 0) {
            dprintf(2, "supervisor: cannot put the agent's supervisor in its cgroup: %s\n", strerror(errno));
            moved = 0;
        }
        close(cgroup_fds[i]);
    }
    if (!moved) {
        kill(pid, SIGKILL);
        return 1;
    }
    int notify = pid < 0 ? -1 : receive_fd(links[0]);
    close(links[0]);
    char byte;
    if (pid < 0 || read(ready[0], &byte, 1) != 1) {
        dprintf(2, "supervisor: the agent's supervisor did not start (%s)\n", pid < 0 ? strerror(errno) : "it exited");
        return 1;
    }
    close(ready[0]);
    signal(SIGCHLD, SIG_IGN);
    if (write_full(1, "ready\n", 6)) return 1;
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    close(devnull);
    serve_keel(control, notify);
}
