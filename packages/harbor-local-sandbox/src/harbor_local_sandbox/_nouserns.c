/* nouserns: forbid new user namespaces inside the user namespace of a process.
 *
 *   nouserns PID
 *
 * Enters PID's user namespace (its owner's process has every capability there) and writes 0 to
 * /proc/sys/user/max_user_namespaces, which the kernel reads per user namespace: nothing in it can
 * create a user namespace any more (whose root would regain every capability). What
 * `nsenter --user=/proc/PID/ns/user --preserve-credentials sh -c 'echo 0 > ...'` does, in one small
 * process instead of two (a box waits for it before it goes on). Credentials are kept (with one id,
 * groups cannot be dropped). Exit codes: 0 done, 1 failed (the reason on standard error).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: nouserns PID\n");
        return 1;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%s/ns/user", argv[1]);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0 || setns(ns, CLONE_NEWUSER) != 0) {
        fprintf(stderr, "nouserns: cannot enter %s: %s\n", path, strerror(errno));
        return 1;
    }
    int knob = open("/proc/sys/user/max_user_namespaces", O_WRONLY | O_CLOEXEC);
    if (knob < 0 || write(knob, "0\n", 2) != 2) {
        fprintf(stderr, "nouserns: cannot set user.max_user_namespaces: %s\n", strerror(errno));
        return 1;
    }
    return 0;
}
