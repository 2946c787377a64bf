/*
 * forwarder: makes every TCP listener of a sandbox's network namespace (the agent's) reachable at
 * the same address and port in the network namespace of its verifier, and the verifier's own
 * services reachable back by the agent's processes while they answer the verifier.
 *
 * Compiled statically on first use by _binaries.py (static_binary("forwarder")) and cached by source
 * hash; the keel's "forward PID" request runs it (fexecve, empty environment, stdin and stderr on /dev/null,
 * stdout a pipe the keel reads once).
 *
 *   usage: forwarder AGENT_NETNS_FD VIEW_NETNS_FD VIEW_PIDFD [BIND_NOTIFY_FD]
 *
 * It starts in the agent's network namespace, with CAP_SYS_ADMIN in the user namespace that owns
 * both namespaces, and inherits three descriptors: the two namespaces (/proc/PID/ns/net) and a pidfd
 * of the verifier's supervisor. It is single-threaded and moves itself between the two namespaces
 * with setns(2); a socket keeps the namespace it was created in, so it lives in the agent's and
 * enters the verifier's (the *view*) only for the moment it takes to create listening sockets.
 *
 * Every 50 ms, and at once at start, it lists the agent's listening TCP sockets (v4 and v6). For
 * each address and port listened on there it keeps a listener at the same address and port in the
 * view (SO_REUSEADDR; IPv6 ones with IPV6_V6ONLY=1, and an IPv4-mapped address counts as IPv4).
 * The agent's `::` may be dual-stack: it is also mirrored on 0.0.0.0 of its port when the agent
 * listens on no IPv4 address of that port. A port that cannot be bound in the view (the verifier's
 * own server has it, or the view lacks the address) is skipped and tried again the next round. A
 * listener the agent no longer has (missing from two lists in a row: a list read while sockets
 * come and go may skip one) is closed, so the verifier can start the agent's service itself.
 *
 * Each connection accepted in the view is relayed to a new connection made in the agent's
 * namespace to the same port, at the listener's address (0.0.0.0 -> 127.0.0.1, :: -> ::1). Relays
 * are non-blocking and driven by one epoll loop: at most 64 KiB are buffered per direction (a side
 * is not read while its peer's buffer is full), an EOF is passed on (shutdown(SHUT_WR)) once what
 * came before it is written, and a pair is closed when both directions are done. An error on one
 * side resets the other (SO_LINGER 0); a connection the agent refuses is reset in the view. At
 * most 2048 pairs are relayed at once (fewer when RLIMIT_NOFILE's hard limit is low); beyond that,
 * new connections are accepted and closed. When descriptors run out, accepting pauses until the
 * next round instead of spinning on a listener that stays readable.
 *
 * How the listeners are listed. /proc/thread-self/net/tcp{,6} (state 0A) was the first choice:
 * checked on Linux 6.18, a file opened there after setns(2) describes the namespace the thread is
 * in at the moment of the open (so do /proc/self/net and /proc/net, and even an openat(2) on a
 * descriptor of /proc/thread-self/net opened before the setns), and keeps describing that one
 * namespace, re-read from offset 0, whatever namespace the reader is in later. But each read of
 * those files walks the host's whole established-socket hash table (shared by every namespace):
 * 4 ms per file on a host with 262144 buckets, 16% of a CPU at 20 rounds a second for the two. A
 * sock_diag netlink dump that asks for listeners only reads the listening table instead (30 us for
 * both families), and a netlink socket, like any socket, asks the namespace it was created in.
 * So the forwarder makes one in the agent's namespace at start, and falls back to the /proc files
 * (opened at start, in the agent's namespace, and kept open) only where sock_diag is unavailable
 * (a kernel without CONFIG_INET_DIAG); it then also spaces its rounds so that listing takes at most
 * 1/20 of the time. The environment variable FORWARDER_SCAN=proc forces the fallback (for tests;
 * the keel passes an empty environment).
 *
 * After its first round it writes one byte to its standard output (the keel waits for it before it
 * answers that the view is ready), then points it at /dev/null.
 *
 * With BIND_NOTIFY_FD (a seccomp listener for the verifier's bind(2) calls), the verifier's own
 * servers take precedence: a port a process of the verifier's binds is released and not mirrored
 * again (see "the verifier's own servers" below).
 *
 * The verifier's services, back to the agent (a service the tests start or restart that the agent's
 * server uses: a database, a queue). Each round also lists the view's listeners, its own mirrors
 * left out (by socket inode; the agent's list leaves out the mirrors made there the same way, so no
 * connection is relayed in a loop). For each address and port the verifier listens on where the
 * agent listens on no address of that port, a listener is kept in the agent's namespace, relaying to
 * the verifier's (as under Harbor's shared network, where the tests' service holds the port the
 * agent's server connects to). A connection accepted there is relayed only while a connection of
 * the verifier's to one of the agent's listeners is being relayed — the agent's processes reach the
 * verifier's services while they serve the verifier's requests (the agent's health endpoint that asks
 * the tests' database), never on their own: an agent's job that polls a port for the verifier's
 * fixture server gets a reset. After a bind of the verifier's, the listing runs every 2 ms for
 * 300 ms, so that a service the tests start is reachable from the agent's side about as soon as it
 * listens. The agent keeps what is its own: a port it listens on (at any address) is never taken in
 * its namespace, and the verifier's relayed traffic never passes through the agent's namespace.
 *
 * Only TCP is forwarded: UDP and abstract Unix sockets are not (the verifier does not see them);
 * Unix sockets bound to a path need no forwarding (the verifier sees the agent's files). The agent
 * sees its relayed connections coming from 127.0.0.1 (or ::1), not from the verifier's address.
 *
 * It exits with 0 when VIEW_PIDFD becomes readable (the verifier's supervisor exited), 2 on bad
 * usage, 1 on an unexpected failure (a namespace it cannot enter, no way to list listeners).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#ifndef CLONE_NEWNET
#define CLONE_NEWNET 0x40000000
#endif
#ifndef SOCK_DIAG_BY_FAMILY
#define SOCK_DIAG_BY_FAMILY 20
#endif
#define TCP_LISTEN_STATE 10 /* TCP_LISTEN in the kernel's numbering: 0A in /proc/net/tcp */
#define SCAN_MS 50
#define FAST_SCAN_MS 2     /* after a bind of the verifier's ... */
#define FAST_WINDOW_MS 300 /* ... for this long */
#define MISSES_TO_CLOSE 2
#define BUF_SIZE (64 * 1024)
#define MAX_PAIRS 2048
#define MAX_LISTENERS 512
#define ACCEPT_BATCH 64
#define MAX_EVENTS 256

/* What an epoll event belongs to (bits 28-31 of its tag). */
enum kind { WATCH = 1, LISTENER = 2, PAIR = 3, BINDS = 4 };
/* The two sides of a relayed connection: the one accepted at a mirror, the one it dialed. */
enum side { ACCEPTED = 0, DIALED = 1 };

/* An address and port listened on: family AF_INET (addr[0..3]) or AF_INET6. */
struct endpoint {
    int family;
    unsigned char addr[16];
    unsigned short port;
};

/* A mirror: a listener in the view for one of the agent's, or (back) one in the agent's namespace
 * for one of the verifier's; fd -1: a free slot. */
struct listener {
    struct endpoint at;
    int fd;
    int back;           /* 0: in the view, relays into the agent's namespace; 1: the other way */
    unsigned long ino;  /* its socket's inode: how the lists leave the mirrors out */
    int misses;         /* consecutive lists of the mirrored side's listeners it was missing from */
};

/* How one namespace's listeners are listed (a netlink socket, or its /proc files, opened there) and
 * the last list. */
struct listing {
    int diag;
    int proc_fd[2]; /* tcp, tcp6 */
    struct endpoint found[MAX_LISTENERS];
    int n_found;
};

/* A relayed connection. buf[i] holds what was read from fd[i] and is still to be written to fd[!i]:
 * len[i] bytes from off[i]; it is allocated on demand and freed when empty. */
struct pair {
    int fd[2];
    char *buf[2];
    unsigned len[2], off[2];
    unsigned char eof[2];  /* fd[i] sent its FIN */
    unsigned char shut[2]; /* fd[i] was shut down for writing */
    unsigned char connecting, used, serving; /* serving: the verifier's connection to the agent's */
    uint32_t armed[2]; /* events registered for fd[i]; 0: not in the epoll set */
    uint32_t gen;      /* tells a stale event (of a pair closed in the same batch) from a live one */
};

static int agent_ns, view_ns, watched, ep, binds = -1;
/* Ports a process of the verifier's bound (its own server): never mirrored again (see yield_port). */
static unsigned char yielded[65536];
static struct listing agent_list = {.diag = -1, .proc_fd = {-1, -1}}, view_list = {.diag = -1, .proc_fd = {-1, -1}};
static uint32_t diag_seq;
static struct listener listeners[MAX_LISTENERS];
static int accepting_paused;
static int serving; /* pairs relaying a connection of the verifier's to one of the agent's listeners */
static int64_t fast_until;
static struct pair *pairs;
static int *free_pairs, n_free, max_pairs;

/* Nothing sensible is left to do: the caller (the keel) sees exit code 1. */
static void die(void) {
    _exit(1);
}

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Moves this (only) thread into a network namespace; a forwarder that cannot must stop, or it
 * would connect in the wrong one. */
static void enter(int ns) {
    if (setns(ns, CLONE_NEWNET) != 0) die();
}

/* A descriptor number from the command line, or -1. */
static int parse_fd(const char *text) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < 0 || v > 1 << 30) return -1;
    if (fcntl((int)v, F_GETFD) < 0) return -1;
    return (int)v;
}

/* ---- listing a namespace's listeners ---- */

/* Whether a socket inode is one of our mirrors (left out of both lists). */
static int is_mirror(unsigned long ino) {
    for (int i = 0; i < MAX_LISTENERS && ino != 0; i++)
        if (listeners[i].fd >= 0 && listeners[i].ino == ino) return 1;
    return 0;
}

/* Records an endpoint once, unless it is a mirror of ours; an IPv4-mapped IPv6 address is recorded
 * as the IPv4 address. */
static void add_found(struct listing *l, int family, const unsigned char *addr, unsigned short port,
                      unsigned long ino) {
    static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (is_mirror(ino)) return;
    struct endpoint e = {.family = family, .port = port};
    if (family == AF_INET6 && memcmp(addr, mapped, 12) == 0) {
        e.family = AF_INET;
        memcpy(e.addr, addr + 12, 4);
    } else {
        memcpy(e.addr, addr, family == AF_INET ? 4 : 16);
    }
    for (int i = 0; i < l->n_found; i++)
        if (memcmp(&l->found[i], &e, sizeof e) == 0) return; /* SO_REUSEPORT groups list one per socket */
    if (l->n_found < MAX_LISTENERS) l->found[l->n_found++] = e;
}

/* Asks sock_diag for the listening TCP sockets of one family; 0, or -1 if the dump failed. */
static int diag_list(struct listing *l, int family) {
    struct {
        struct nlmsghdr h;
        struct inet_diag_req_v2 r;
    } q;
    memset(&q, 0, sizeof q);
    q.h.nlmsg_len = sizeof q;
    q.h.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    q.h.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
    q.h.nlmsg_seq = ++diag_seq;
    q.r.sdiag_family = (uint8_t)family;
    q.r.sdiag_protocol = IPPROTO_TCP;
    q.r.idiag_states = 1u << TCP_LISTEN_STATE; /* listeners only: the kernel skips the other tables */
    if (send(l->diag, &q, sizeof q, MSG_NOSIGNAL) != (ssize_t)sizeof q) return -1;
    static char buf[64 * 1024] __attribute__((aligned(NLMSG_ALIGNTO)));
    for (;;) {
        ssize_t n = recv(l->diag, buf, sizeof buf, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n); h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_seq != diag_seq) continue; /* the rest of an earlier, failed dump */
            if (h->nlmsg_type == NLMSG_DONE) return 0;
            if (h->nlmsg_type == NLMSG_ERROR) return -1;
            if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY || h->nlmsg_len < NLMSG_LENGTH(sizeof(struct inet_diag_msg)))
                continue;
            struct inet_diag_msg *m = NLMSG_DATA(h);
            if (m->idiag_state != TCP_LISTEN_STATE || m->idiag_family != family) continue;
            add_found(l, family, (const unsigned char *)m->id.idiag_src, ntohs(m->id.idiag_sport), m->idiag_inode);
        }
    }
}

/* Parses one line of /proc/net/tcp{,6}: 1 a listener (recorded), 0 a socket in another state,
 * -1 not a socket (the header). */
static int proc_line(struct listing *l, const char *line, int family) {
    char hex[33];
    unsigned port, state;
    unsigned long ino;
    if (sscanf(line, " %*u: %32[0-9A-Fa-f]:%x %*[0-9A-Fa-f]:%*x %x %*x:%*x %*x:%*x %*x %*u %*u %lu", hex, &port, &state,
               &ino) != 4)
        return -1;
    if (state != TCP_LISTEN_STATE) return 0;
    size_t words = family == AF_INET ? 1 : 4;
    if (strlen(hex) != words * 8) return -1;
    unsigned char addr[16];
    for (size_t i = 0; i < words; i++) {
        /* The kernel prints each 32-bit word of the address as the number its bytes make in memory. */
        char word[9];
        memcpy(word, hex + 8 * i, 8);
        word[8] = 0;
        uint32_t v = (uint32_t)strtoul(word, NULL, 16);
        memcpy(addr + 4 * i, &v, 4);
    }
    add_found(l, family, addr, (unsigned short)port, ino);
    return 1;
}

/* Re-reads an open /proc/net/tcp{,6} from its start. The kernel lists every listener before any
 * other socket (the listening table, then the established one), so reading stops at the first
 * socket in another state. 0, or -1 on a read error. */
static int proc_list(struct listing *l, int fd, int family) {
    static char buf[64 * 1024];
    size_t have = 0;
    if (lseek(fd, 0, SEEK_SET) != 0) return -1;
    for (;;) {
        ssize_t n = read(fd, buf + have, sizeof buf - 1 - have);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1;
        if (n == 0) return 0;
        have += (size_t)n;
        buf[have] = 0;
        char *line = buf, *nl;
        while ((nl = strchr(line, '\n')) != NULL) {
            *nl = 0;
            if (proc_line(l, line, family) == 0) return 0;
            line = nl + 1;
        }
        have = strlen(line);
        memmove(buf, line, have);
        if (have == sizeof buf - 1) have = 0; /* no line is that long: drop the garbage */
    }
}

/* Chooses how to list listeners, in the namespace this thread is in (that of the listing): a
 * sock_diag netlink socket, else the /proc files; 0, or -1 if neither works. */
static int open_listing(struct listing *l) {
    const char *mode = getenv("FORWARDER_SCAN");
    if (mode == NULL || strcmp(mode, "proc") != 0) {
        l->diag = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
        struct timeval tv = {.tv_sec = 2};
        if (l->diag >= 0) setsockopt(l->diag, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv); /* a dump never hangs us */
        if (l->diag >= 0 && diag_list(l, AF_INET) == 0) return 0;
        if (l->diag >= 0) close(l->diag);
        l->diag = -1;
    }
    const char *paths[2][2] = {{"/proc/thread-self/net/tcp", "/proc/self/net/tcp"},
                               {"/proc/thread-self/net/tcp6", "/proc/self/net/tcp6"}};
    for (int f = 0; f < 2; f++) /* /proc/self: kernels before 3.17 have no thread-self (one thread) */
        for (int k = 0; k < 2 && l->proc_fd[f] < 0; k++) l->proc_fd[f] = open(paths[f][k], O_RDONLY | O_CLOEXEC);
    l->n_found = 0;
    return l->proc_fd[0] >= 0 && proc_list(l, l->proc_fd[0], AF_INET) == 0 ? 0 : -1; /* tcp6 is absent without IPv6 */
}

static int is_any(const struct endpoint *e) {
    static const unsigned char zero[16];
    return memcmp(e->addr, zero, e->family == AF_INET ? 4 : 16) == 0;
}

/* Adds 0.0.0.0:P for each `::` listener on a port P with no IPv4 listener: `::` may be dual-stack
 * (if it is not, the connections relayed to 127.0.0.1 are refused there, as they would have been). */
static void add_dual_stack(struct listing *l) {
    int n = l->n_found;
    for (int i = 0; i < n; i++) {
        if (l->found[i].family != AF_INET6 || !is_any(&l->found[i])) continue;
        int has_v4 = 0;
        for (int j = 0; j < n && !has_v4; j++)
            has_v4 = l->found[j].family == AF_INET && l->found[j].port == l->found[i].port;
        static const unsigned char any[16];
        if (!has_v4) add_found(l, AF_INET, any, l->found[i].port, 0);
    }
}

/* Fills a listing's found[] with its namespace's listeners, our mirrors left out; 0, or -1 if the
 * list could not be read (nothing is closed on the strength of a failed read). */
static int list_listeners(struct listing *l) {
    l->n_found = 0;
    if (l->diag >= 0) {
        if (diag_list(l, AF_INET) != 0 || diag_list(l, AF_INET6) != 0) return -1;
    } else {
        if (proc_list(l, l->proc_fd[0], AF_INET) != 0) return -1;
        if (l->proc_fd[1] >= 0 && proc_list(l, l->proc_fd[1], AF_INET6) != 0) return -1;
    }
    add_dual_stack(l);
    return 0;
}

/* ---- the mirrors ---- */

/* The socket address of an endpoint; with `loopback`, a wildcard becomes 127.0.0.1 or ::1. */
static socklen_t sockaddr_of(const struct endpoint *e, int loopback, struct sockaddr_storage *ss) {
    memset(ss, 0, sizeof *ss);
    if (e->family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)ss;
        a->sin_family = AF_INET;
        a->sin_port = htons(e->port);
        memcpy(&a->sin_addr, e->addr, 4);
        if (loopback && is_any(e)) a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        return sizeof *a;
    }
    struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(e->port);
    memcpy(&a->sin6_addr, e->addr, 16);
    if (loopback && is_any(e)) a->sin6_addr = in6addr_loopback;
    return sizeof *a;
}

static int find_listener(const struct endpoint *e, int back) {
    for (int i = 0; i < MAX_LISTENERS; i++)
        if (listeners[i].fd >= 0 && listeners[i].back == back && memcmp(&listeners[i].at, e, sizeof *e) == 0) return i;
    return -1;
}

static int is_found(const struct listing *l, const struct endpoint *e) {
    for (int i = 0; i < l->n_found; i++)
        if (memcmp(&l->found[i], e, sizeof *e) == 0) return 1;
    return 0;
}

/* Whether a listing holds a listener on this port, at any address. */
static int has_port(const struct listing *l, unsigned short port) {
    for (int i = 0; i < l->n_found; i++)
        if (l->found[i].port == port) return 1;
    return 0;
}

/* Binds and starts a socket listening at e; 0, or -1 (the port is taken in its namespace, or the
 * namespace lacks the address). */
static int start_listening(int fd, const struct endpoint *e) {
    int one = 1;
    struct sockaddr_storage ss;
    socklen_t len = sockaddr_of(e, 0, &ss);
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) return -1;
    if (e->family == AF_INET6 && setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one) != 0) return -1;
    if (bind(fd, (struct sockaddr *)&ss, len) != 0) return -1;
    return listen(fd, SOMAXCONN);
}

/* Whether the mirrored side's listener at e is wanted (forward: the agent's, unless the verifier took
 * the port; back: the verifier's, where the agent listens on no address of that port). */
static int wanted(const struct endpoint *e, int back) {
    return back ? !has_port(&agent_list, e->port) : !yielded[e->port];
}

/* Makes the mirrors one direction lacks: the sockets are created in the namespace they listen in (a
 * forward mirror's in the view, all in one visit), bound and registered back in the agent's. */
static void open_missing(int back) {
    const struct listing *src = back ? &view_list : &agent_list;
    int want[MAX_LISTENERS], fds[MAX_LISTENERS], n = 0, free_slots = 0;
    for (int i = 0; i < MAX_LISTENERS; i++) free_slots += listeners[i].fd < 0;
    for (int i = 0; i < src->n_found && n < free_slots; i++)
        if (find_listener(&src->found[i], back) < 0 && wanted(&src->found[i], back)) want[n++] = i;
    if (n == 0) return;
    if (!back) enter(view_ns);
    for (int k = 0; k < n; k++)
        fds[k] = socket(src->found[want[k]].family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (!back) enter(agent_ns);
    for (int k = 0, slot = 0; k < n; k++) {
        if (fds[k] < 0) continue;
        while (listeners[slot].fd >= 0) slot++;
        struct epoll_event ev = {.events = accepting_paused ? 0 : EPOLLIN, .data.u64 = (uint64_t)LISTENER << 28 | (uint64_t)slot};
        struct stat st;
        if (start_listening(fds[k], &src->found[want[k]]) != 0 || fstat(fds[k], &st) != 0 ||
            epoll_ctl(ep, EPOLL_CTL_ADD, fds[k], &ev) != 0) {
            close(fds[k]); /* tried again next round */
            continue;
        }
        listeners[slot] = (struct listener){.at = src->found[want[k]], .fd = fds[k], .back = back, .ino = st.st_ino};
    }
}

/* Closes the mirrors whose mirrored listener is gone (or, back, that the agent now listens on
 * itself), and opens those that are new. */
static void reconcile(void) {
    for (int i = 0; i < MAX_LISTENERS; i++) {
        struct listener *l = &listeners[i];
        if (l->fd < 0) continue;
        if (is_found(l->back ? &view_list : &agent_list, &l->at) && wanted(&l->at, l->back)) {
            l->misses = 0;
        } else if (++l->misses >= MISSES_TO_CLOSE) {
            close(l->fd); /* leaves the epoll set with it */
            l->fd = -1;
        }
    }
    open_missing(0);
    open_missing(1);
}

/* Stops (or resumes) watching the listeners: out of descriptors, a pending connection keeps its
 * listener readable, and accepting again at once would spin. */
static void set_accepting(int on) {
    if (accepting_paused == !on) return;
    accepting_paused = !on;
    for (int i = 0; i < MAX_LISTENERS; i++) {
        if (listeners[i].fd < 0) continue;
        struct epoll_event ev = {.events = on ? EPOLLIN : 0, .data.u64 = (uint64_t)LISTENER << 28 | (uint64_t)i};
        epoll_ctl(ep, EPOLL_CTL_MOD, listeners[i].fd, &ev);
    }
}

/* ---- relayed connections ---- */

/* Closes a descriptor, with a reset (RST) instead of an orderly FIN when `reset`. */
static void close_socket(int fd, int reset) {
    if (fd < 0) return;
    if (reset) {
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    }
    close(fd);
}

static void close_pair(struct pair *p, int reset) {
    serving -= p->serving;
    for (int i = 0; i < 2; i++) {
        close_socket(p->fd[i], reset);
        free(p->buf[i]);
    }
    uint32_t gen = p->gen + 1;
    memset(p, 0, sizeof *p);
    p->gen = gen;
    free_pairs[n_free++] = (int)(p - pairs);
}

/* Registers for fd[i] the events that can make progress now; a side with none leaves the epoll set
 * (an EPOLLHUP it could not act on would otherwise be reported again and again). */
static int arm(struct pair *p, int i) {
    uint32_t want = 0;
    if (p->connecting) {
        if (i == DIALED) want = EPOLLOUT;
    } else {
        if (!p->eof[i] && p->len[i] < BUF_SIZE) want |= EPOLLIN;
        if (p->len[!i] > 0) want |= EPOLLOUT;
    }
    if (want == p->armed[i]) return 0;
    struct epoll_event ev = {.events = want, .data.u64 = (uint64_t)p->gen << 32 | (uint64_t)PAIR << 28 | (uint64_t)((p - pairs) << 1 | i)};
    int op = want == 0 ? EPOLL_CTL_DEL : p->armed[i] == 0 ? EPOLL_CTL_ADD : EPOLL_CTL_MOD;
    if (epoll_ctl(ep, op, p->fd[i], &ev) != 0) return -1;
    p->armed[i] = want;
    return 0;
}

/* Writes what can be written both ways, passes on EOFs whose data is through, and closes the pair
 * when both directions are done (or resets it on an error); otherwise re-arms both sides. */
static void pump(struct pair *p) {
    for (int i = 0; i < 2 && !p->connecting; i++) {
        while (p->len[i] > 0) {
            ssize_t n = send(p->fd[!i], p->buf[i] + p->off[i], p->len[i], MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
            if (n <= 0) {
                close_pair(p, 1);
                return;
            }
            p->off[i] += (unsigned)n;
            p->len[i] -= (unsigned)n;
        }
        if (p->len[i] == 0 && p->buf[i] != NULL) { /* an idle pair holds no buffer */
            free(p->buf[i]);
            p->buf[i] = NULL;
            p->off[i] = 0;
        }
        if (p->eof[i] && p->len[i] == 0 && !p->shut[!i]) {
            shutdown(p->fd[!i], SHUT_WR);
            p->shut[!i] = 1;
        }
    }
    if (p->shut[0] && p->shut[1]) {
        close_pair(p, 0);
        return;
    }
    if (arm(p, 0) != 0 || arm(p, 1) != 0) close_pair(p, 1);
}

/* Reads what fits into buf[i]; returns -1 (the pair was reset) on an error. */
static int fill(struct pair *p, int i) {
    if (p->eof[i] || p->len[i] >= BUF_SIZE) return 0;
    if (p->buf[i] == NULL && (p->buf[i] = malloc(BUF_SIZE)) == NULL) { /* left armed, it would spin */
        close_pair(p, 1);
        return -1;
    }
    if (p->off[i] > 0) {
        memmove(p->buf[i], p->buf[i] + p->off[i], p->len[i]);
        p->off[i] = 0;
    }
    ssize_t n;
    do n = recv(p->fd[i], p->buf[i] + p->len[i], BUF_SIZE - p->len[i], MSG_DONTWAIT); while (n < 0 && errno == EINTR);
    if (n > 0) {
        p->len[i] += (unsigned)n;
    } else if (n == 0) {
        p->eof[i] = 1;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
        close_pair(p, 1);
        return -1;
    }
    return 0;
}

/* Handles events on one side of a pair: the end of the agent side's connect, or data. */
static void on_pair(struct pair *p, int i, uint32_t events) {
    if (p->connecting) {
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(p->fd[DIALED], SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        if (err != 0) {
            close_pair(p, 1); /* refused there: the client gets a reset */
            return;
        }
        if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
        p->connecting = 0;
    } else if (events & EPOLLERR) {
        close_pair(p, 1);
        return;
    } else if ((events & (EPOLLIN | EPOLLHUP)) && fill(p, i) != 0) {
        return;
    }
    pump(p);
}

/* Sets the options both sides of a pair get: relayed writes go out at once (no Nagle delay added
 * on top of the client's own). */
static void tune(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Relays a connection accepted at mirror l to a new connection to the mirrored listener, in the
 * other namespace. One accepted at a back mirror is reset unless the verifier's connection to one of
 * the agent's listeners is being relayed (the agent's processes reach the verifier's services while
 * they answer the verifier). */
static void start_pair(int conn, const struct listener *l) {
    if (l->back && serving == 0) {
        close_socket(conn, 1);
        return;
    }
    struct sockaddr_storage ss;
    socklen_t len = sockaddr_of(&l->at, 1, &ss);
    if (l->back) enter(view_ns);
    int out = socket(l->at.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (l->back) enter(agent_ns);
    if (out < 0) {
        if (errno == EMFILE || errno == ENFILE) set_accepting(0);
        close_socket(conn, 1);
        return;
    }
    tune(conn);
    tune(out);
    int rc = connect(out, (struct sockaddr *)&ss, len);
    if (rc != 0 && errno != EINPROGRESS) {
        close(out);
        close_socket(conn, 1);
        return;
    }
    struct pair *p = &pairs[free_pairs[--n_free]];
    p->used = 1;
    p->serving = !l->back;
    serving += p->serving;
    p->fd[ACCEPTED] = conn;
    p->fd[DIALED] = out;
    p->connecting = rc != 0;
    pump(p);
}

/* Accepts what a listener has pending (a bounded batch: one busy port must not starve the rest). */
static void on_listener(struct listener *l) {
    for (int k = 0; k < ACCEPT_BATCH && !accepting_paused; k++) {
        int conn = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (conn < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) set_accepting(0);
            return;
        }
        if (n_free == 0) {
            close_socket(conn, 1); /* at the bound on pairs */
            continue;
        }
        start_pair(conn, l);
    }
}

/* ---- setup and the loop ---- */

/* As many pairs as the descriptor limit allows, up to MAX_PAIRS (two descriptors each, and room
 * for the listeners and a few more). */
static void size_pairs(void) {
    struct rlimit rl;
    long limit = 1024;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) == 0 || getrlimit(RLIMIT_NOFILE, &rl) == 0)
            limit = rl.rlim_cur > (1 << 20) ? 1 << 20 : (long)rl.rlim_cur;
    }
    long room = (limit - MAX_LISTENERS - 32) / 2;
    max_pairs = room < 16 ? 16 : room > MAX_PAIRS ? MAX_PAIRS : (int)room;
    pairs = calloc((size_t)max_pairs, sizeof *pairs);
    free_pairs = calloc((size_t)max_pairs, sizeof *free_pairs);
    if (pairs == NULL || free_pairs == NULL) die();
    for (int i = max_pairs - 1; i >= 0; i--) free_pairs[n_free++] = i;
}

/* ---- the verifier's own servers ----
 *
 * The agent could listen first on a port the verifier's tests mean to serve on (a fixture server the
 * checked program talks to): mirrored, it would take that port in the view and answer in the
 * verifier's stead. So the verifier's supervisor sends every bind(2) of the verifier's processes here
 * first (seccomp user notification, BIND_NOTIFY_FD): the port it asks for is released and never
 * mirrored again, then the bind goes on as asked. The verifier's own server always gets its port. */

#ifndef SECCOMP_IOCTL_NOTIF_RECV
#include <linux/seccomp.h>
#include <sys/ioctl.h>
#endif

/* Releases port (all its mirrored listeners) for good. */
static void yield_port(unsigned short port) {
    if (port == 0 || yielded[port]) return;
    yielded[port] = 1;
    for (int i = 0; i < MAX_LISTENERS; i++)
        if (listeners[i].fd >= 0 && listeners[i].at.port == port) {
            close(listeners[i].fd);
            listeners[i].fd = -1;
        }
}

/* Answers one notification: reads the address the verifier's process binds, yields its port, lets
 * the bind go on (whatever happens here, it goes on: the verifier is not ours to refuse). */
static void on_bind(void) {
    struct seccomp_notif req;
    struct seccomp_notif_resp resp;
    memset(&req, 0, sizeof req);
    memset(&resp, 0, sizeof resp);
    if (ioctl(binds, SECCOMP_IOCTL_NOTIF_RECV, &req) != 0) return;
    resp.id = req.id;
    resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/mem", (int)req.pid);
    int mem = open(path, O_RDONLY | O_CLOEXEC);
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    size_t len = req.data.args[2] < sizeof ss ? (size_t)req.data.args[2] : sizeof ss;
    if (mem >= 0 && pread(mem, &ss, len, (off_t)req.data.args[1]) >= (ssize_t)sizeof(sa_family_t)) {
        if (ss.ss_family == AF_INET) yield_port(ntohs(((struct sockaddr_in *)&ss)->sin_port));
        if (ss.ss_family == AF_INET6) yield_port(ntohs(((struct sockaddr_in6 *)&ss)->sin6_port));
    }
    if (mem >= 0) close(mem);
    ioctl(binds, SECCOMP_IOCTL_NOTIF_SEND, &resp);
    fast_until = now_us() + FAST_WINDOW_MS * 1000; /* its listen(2) follows: mirror it back soon */
}

/* Dispatches one epoll event; returns 1 when the verifier's supervisor has exited. */
static int dispatch(const struct epoll_event *ev) {
    uint64_t tag = ev->data.u64;
    unsigned kind = (unsigned)(tag >> 28) & 0xf, index = (unsigned)(tag & 0x0fffffff);
    if (kind == WATCH) return 1;
    if (kind == BINDS) {
        if (ev->events & EPOLLIN) on_bind();
        else if (ev->events & (EPOLLHUP | EPOLLERR)) {
            /* No process holds the filter any more: the view is exiting, and its pidfd is readable
             * soon. Until then a hung-up listener is ready for ever: left in the set, it would spin
             * this loop at full speed against the exiting view (150 ms of a CPU per view, measured
             * under load). */
            epoll_ctl(ep, EPOLL_CTL_DEL, binds, NULL);
            close(binds);
            binds = -1;
        }
        return 0;
    }
    if (kind == LISTENER) {
        if (index < MAX_LISTENERS && listeners[index].fd >= 0) on_listener(&listeners[index]);
        return 0;
    }
    struct pair *p = &pairs[(index >> 1) % (unsigned)max_pairs];
    if (kind == PAIR && p->used && p->gen == (uint32_t)(tag >> 32)) on_pair(p, (int)(index & 1), ev->events);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) return 2;
    agent_ns = parse_fd(argv[1]);
    view_ns = parse_fd(argv[2]);
    watched = parse_fd(argv[3]);
    if (argc == 5 && (binds = parse_fd(argv[4])) < 0) return 2;
    if (agent_ns < 0 || view_ns < 0 || watched < 0) return 2;
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); /* it holds the view's namespace: nobody may trace it */
    signal(SIGPIPE, SIG_IGN);
    enter(view_ns); /* both must be enterable; it lives in the agent's */
    if (open_listing(&view_list) != 0) die();
    enter(agent_ns);
    for (int i = 0; i < MAX_LISTENERS; i++) listeners[i].fd = -1;
    size_pairs();
    ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)WATCH << 28};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, watched, &ev) != 0) die();
    struct epoll_event bind_ev = {.events = EPOLLIN, .data.u64 = (uint64_t)BINDS << 28};
    if (binds >= 0 && epoll_ctl(ep, EPOLL_CTL_ADD, binds, &bind_ev) != 0) die();
    if (open_listing(&agent_list) != 0) die();

    static struct epoll_event events[MAX_EVENTS];
    int64_t next_scan = 0;
    int announced = 0;
    for (;;) {
        int64_t now = now_us();
        if (now >= next_scan) {
            set_accepting(1);
            if (list_listeners(&agent_list) == 0 && list_listeners(&view_list) == 0) reconcile();
            if (!announced) { /* the view serves the agent's ports now: say so on stdout, once */
                announced = 1;
                int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
                if (write(1, "r", 1) < 0) { /* nobody waits */
                }
                if (devnull >= 0) {
                    dup2(devnull, 1);
                    close(devnull);
                }
            }
            int64_t took = now_us() - now;
            /* Listing may take at most 1/20 of the time (it is cheap with sock_diag). */
            int64_t every = (now < fast_until ? FAST_SCAN_MS : SCAN_MS) * 1000;
            next_scan = now + (took * 20 > every ? took * 20 : every);
        }
        int timeout = (int)((next_scan - now_us() + 999) / 1000);
        int n = epoll_wait(ep, events, MAX_EVENTS, timeout < 0 ? 0 : timeout);
        if (n < 0 && errno != EINTR) die();
        for (int i = 0; i < n; i++)
            if (dispatch(&events[i])) return 0;
    }
}
