/*
 * The process that lives inside a local sandbox for its whole life.
 *
 * Compiled statically on first use by _binaries.py and cached by source hash; it is
 * passed to bubblewrap as an open file descriptor, so it appears nowhere in the
 * sandbox's file system, and it needs nothing of the image (which may have no C
 * library at all).
 *
 *   usage: supervisor LISTEN_FD AS_LIMIT_BYTES NPROC_LIMIT
 *
 * The host hands it an already listening Unix socket (LISTEN_FD); the limits are
 * set on every command (0: none). Each connection carries one command, little-endian:
 *
 *   request:  u32 size | u32 timeout_ms (0: none) | u32 cap | u32 n | n x (u32 len | bytes)
 *             fields: cwd, command, then "KEY=VALUE" environment entries. An empty
 *             cwd marks a control request: command "ps" lists the sandbox's processes
 *             ("PID:START" lines on stdout; PID 1 and the handler excluded); "kill"
 *             kills all of them but the "PID:START" entries in the remaining fields,
 *             and answers how many it killed.
 *   response: i32 exit code | u32 flags (1: timed out)
 *             | stdout: u64 dropped | u32 len | bytes | stderr: the same
 *
 * Every connection is served by a forked handler that makes itself a child
 * subreaper, so every process the command starts (even one that calls setsid and
 * double-forks) stays its descendant. A timeout, or the host closing the connection
 * (a cancelled exec), kills that whole tree. Processes a finished command left in
 * the background keep running, as with `docker exec` into a running container.
 * Output is bounded: at most `cap` bytes per stream are kept (the head and the
 * tail, with a marker in between); the rest is read and dropped so the command
 * never blocks on a full pipe.
 *
 * It runs as PID 1 of the sandbox's PID namespace (bubblewrap --as-pid-1): the
 * kernel never delivers SIGKILL or SIGSTOP to a namespace's init from inside it,
 * so the agent cannot kill it; it is not dumpable and commands run without
 * CAP_SYS_PTRACE, so the agent cannot trace it either.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#define DRAIN_GRACE_MS 50
#define MAX_REQUEST (64u << 20)

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

/* The sandbox's live processes but the supervisor (PID 1) and this handler, one
 * "PID:START" line each. */
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
        char state = proc_stat(entry->d_name, &start);
        if (pid == 1 || pid == me || state == 'Z' || state == 'X' || state == '?') continue;
        if (len + 64 > cap) text = realloc(text, cap *= 2);
        len += (size_t)snprintf(text + len, cap - len, "%d:%llu\n", (int)pid, start);
    }
    if (proc) closedir(proc);
    *out = text;
    return len;
}

/* Kills every process of the sandbox but the supervisor (PID 1), this handler and
 * the "PID:START" entries of keep, repeating until a scan finds none to kill;
 * returns how many were killed. Every process in the namespace is reachable this
 * way, whatever it did to detach (new session, double fork, ignoring SIGTERM). */
static int kill_all(char **keep, uint32_t nkeep) {
    pid_t me = getpid();
    int total = 0;
    for (int round = 0; round < 1000; round++) {
        int killed = 0;
        DIR *proc = opendir("/proc");
        struct dirent *entry;
        while (proc && (entry = readdir(proc))) {
            if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
            pid_t pid = (pid_t)atoi(entry->d_name);
            if (pid == 1 || pid == me) continue;
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
        struct timespec pause = {0, 2000000};
        nanosleep(&pause, NULL);
    }
    return total;
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

/* Reads one request: its timeout, output cap and fields (NULL-terminated). 0 on success. */
static int read_request(int conn, uint32_t *timeout_ms, uint32_t *cap, char ***out, uint32_t *count) {
    uint32_t size;
    if (read_full(conn, &size, 4) || size < 12 || size > MAX_REQUEST) return -1;
    char *req = malloc(size + 1);
    if (read_full(conn, req, size)) {
        free(req);
        return -1;
    }
    const char *p = req, *end = req + size;
    *timeout_ms = get_u32(&p);
    *cap = get_u32(&p);
    uint32_t nfields = get_u32(&p);
    if (*cap < 64) *cap = 64;
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
    if (bad) {
        for (uint32_t i = 0; i < nfields; i++) free(fields[i]);
        free(fields);
        return -1;
    }
    *out = fields;
    *count = nfields;
    return 0;
}

/* Answers a control request (an empty cwd marks one); returns 0 if the request is a command. */
static int serve_control(int conn, char **fields, uint32_t nfields) {
    if (fields[0][0] != 0) return 0;
    if (strcmp(fields[1], "ps") == 0) {
        char *text;
        size_t len = list_processes(&text);
        answer_control(conn, 0, text, len);
    } else if (strcmp(fields[1], "kill") == 0) {
        answer_control(conn, kill_all(fields + 2, nfields - 2), "", 0);
    } else {
        answer_control(conn, -1, "", 0);
    }
    return 1;
}

/* No handler could be forked (the sandbox is at its process limit): control requests are still
 * served, here (a "kill" is how the host frees the sandbox); commands get the reason. */
static void serve_unforked(int conn, int error) {
    uint32_t timeout_ms, cap, nfields;
    char **fields;
    if (read_request(conn, &timeout_ms, &cap, &fields, &nfields)) {
        close(conn);
        return;
    }
    if (!serve_control(conn, fields, nfields)) answer_failure(conn, 126, "fork", error);
    for (uint32_t i = 0; i < nfields; i++) free(fields[i]);
    free(fields);
}

static void handle(int conn) {
    signal(SIGCHLD, SIG_DFL);
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);

    uint32_t timeout_ms, cap, nfields;
    char **fields;
    if (read_request(conn, &timeout_ms, &cap, &fields, &nfields)) return;
    if (serve_control(conn, fields, nfields)) return;
    const char *cwd = fields[0], *cmd = fields[1];
    char **envp = fields + 2; /* NULL-terminated by calloc */

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

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    int listener = atoi(argv[1]);
    if (argc > 2) {
        unsigned long long limit = strtoull(argv[2], NULL, 10);
        if (limit) {
            struct rlimit rl = {limit, limit};
            setrlimit(RLIMIT_AS, &rl);
        }
    }
    if (argc > 3) {
        /* Without cgroups (not root), the sandbox's process limit: RLIMIT_NPROC counts the
         * processes of a uid in its own user namespace, i.e. this sandbox's (a fork bomb gets
         * EAGAIN); commands cannot raise it. */
        unsigned long long limit = strtoull(argv[3], NULL, 10);
        if (limit) {
            struct rlimit rl = {limit, limit};
            setrlimit(RLIMIT_NPROC, &rl);
        }
    }
    fcntl(listener, F_SETFD, FD_CLOEXEC);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); /* inherited by handlers, reset by a command's execve */
    signal(SIGCHLD, SIG_IGN); /* handlers and orphans are reaped by the kernel */
    signal(SIGPIPE, SIG_IGN);
    if (write_full(1, "ready\n", 6)) return 1;
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    close(devnull);
    for (;;) {
        int conn = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            return 1;
        }
        pid_t pid = fork();
        if (pid == 0) {
            close(listener);
            handle(conn);
            _exit(0);
        }
        if (pid < 0) { /* no handler: serve it from here (it is short) and go on */
            serve_unforked(conn, errno);
            continue;
        }
        close(conn);
    }
}
