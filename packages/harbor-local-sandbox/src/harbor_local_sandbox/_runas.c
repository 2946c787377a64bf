/* runas: run a command as one of the image's users inside an image-rooted sandbox.
 *
 *   runas USER[:GROUP] COMMAND [ARG...]
 *
 * USER and GROUP are names from the image's /etc/passwd and /etc/group, or numbers, as
 * with `docker exec -u`. Sets the supplementary groups from /etc/group, the group, then
 * the user (which drops every capability), and HOME, USER and LOGNAME unless HOME is
 * already set. Linked statically: the image's C library may differ from the host's.
 * Exit codes: 125 bad user, 126 cannot switch, 127 cannot run COMMAND.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_GROUPS 256

static int is_number(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return 0;
    return 1;
}

/* Field n (0-based) of a colon-separated line, copied into out. */
static int field(const char *line, int n, char *out, size_t size) {
    const char *p = line;
    for (int i = 0; i < n; i++) {
        p = strchr(p, ':');
        if (!p) return 0;
        p++;
    }
    size_t len = strcspn(p, ":\n");
    if (len >= size) len = size - 1;
    memcpy(out, p, len);
    out[len] = 0;
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: runas USER[:GROUP] COMMAND [ARG...]\n");
        return 125;
    }
    char spec[512];
    snprintf(spec, sizeof spec, "%s", argv[1]);
    char *group = strchr(spec, ':');
    if (group) *group++ = 0;
    const char *user = spec;

    uid_t uid = 0;
    gid_t gid = 0;
    int found = 0;
    char name[256] = "", home[1024] = "/", buf[4096], value[1024];
    /* A verifier's view binds the image's own account files here: the verifier's user is the image's,
     * whatever the agent wrote into /etc/passwd (which the tests still see as the agent left it). */
    FILE *passwd = fopen("/run/harbor-local-sandbox/passwd", "r");
    if (!passwd) passwd = fopen("/etc/passwd", "r");
    if (passwd) {
        while (fgets(buf, sizeof buf, passwd)) {
            if (!field(buf, 0, name, sizeof name) || !field(buf, 2, value, sizeof value)) continue;
            if (is_number(user) ? (uid_t)strtoul(user, NULL, 10) == (uid_t)strtoul(value, NULL, 10)
                                : strcmp(name, user) == 0) {
                uid = (uid_t)strtoul(value, NULL, 10);
                if (field(buf, 3, value, sizeof value)) gid = (gid_t)strtoul(value, NULL, 10);
                if (!field(buf, 5, home, sizeof home) || !home[0]) strcpy(home, "/");
                found = 1;
                break;
            }
        }
        fclose(passwd);
    }
    if (!found) {
        if (!is_number(user)) {
            fprintf(stderr, "runas: no user %s in the sandbox's /etc/passwd\n", user);
            return 125;
        }
        uid = (uid_t)strtoul(user, NULL, 10);
        snprintf(name, sizeof name, "%s", user);
    }

    gid_t groups[MAX_GROUPS];
    int ngroups = 0;
    int group_found = group == NULL;
    FILE *etc_group = fopen("/run/harbor-local-sandbox/group", "r");
    if (!etc_group) etc_group = fopen("/etc/group", "r");
    if (etc_group) {
        char gname[256], gid_text[64], members[2048];
        while (fgets(buf, sizeof buf, etc_group)) {
            if (!field(buf, 0, gname, sizeof gname) || !field(buf, 2, gid_text, sizeof gid_text)) continue;
            gid_t this_gid = (gid_t)strtoul(gid_text, NULL, 10);
            if (group && !group_found &&
                (is_number(group) ? (gid_t)strtoul(group, NULL, 10) == this_gid : strcmp(gname, group) == 0)) {
                gid = this_gid;
                group_found = 1;
            }
            if (found && field(buf, 3, members, sizeof members)) {
                for (char *m = strtok(members, ","); m; m = strtok(NULL, ","))
                    if (strcmp(m, name) == 0 && ngroups < MAX_GROUPS - 1) groups[ngroups++] = this_gid;
            }
        }
        fclose(etc_group);
    }
    if (!group_found) {
        if (!is_number(group)) {
            fprintf(stderr, "runas: no group %s in the sandbox's /etc/group\n", group);
            return 125;
        }
        gid = (gid_t)strtoul(group, NULL, 10);
    }
    groups[ngroups++] = gid;

    if (setgroups((size_t)ngroups, groups) != 0 || setgid(gid) != 0 || setuid(uid) != 0) {
        fprintf(stderr, "runas: cannot switch to %s: %s\n", argv[1], strerror(errno));
        return 126;
    }
    if (!getenv("HOME")) setenv("HOME", home, 1);
    setenv("USER", name, 1);
    setenv("LOGNAME", name, 1);
    execvp(argv[2], argv + 2);
    fprintf(stderr, "runas: cannot run %s: %s\n", argv[2], strerror(errno));
    return 127;
}
