/* argv_secret: keeps a secret out of tritonserver's command line (stoker/containers/argv_secret.py builds it).
 *
 * Triton takes its restricted-API key only as an argument (--http-restricted-api=APIS:HEADER=KEY), and the kernel
 * shows a process's original argv to every local user in /proc/PID/cmdline. stoker therefore starts tritonserver
 * with a placeholder where the key goes and the key in the environment (/proc/PID/environ: the process's owner and
 * root only), with this library in LD_PRELOAD. Before main, in a process whose argv[0] is named tritonserver, it
 * copies argv to the heap with the placeholder replaced by the environment's value, wipes that value from the
 * environment block the kernel shows, and removes the variable, so Triton's children (python backend stubs) never
 * inherit it. Every other process (mpirun, its daemons, stubs, shells) is left as it is: mpirun hands each rank the
 * placeholder and the environment, and each rank substitutes for itself.
 *
 * A tritonserver with the placeholder in its argv but no value exits at once with one line on stderr: it must never
 * serve with the literal placeholder as its key.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PLACEHOLDER "@STOKER_ADMIN_TOKEN@"
#define VARIABLE "STOKER_ADMIN_TOKEN"
#define PROGRAM "tritonserver"

typedef int (*main_fn)(int, char **, char **);
typedef int (*start_fn)(main_fn, int, char **, void (*)(void), void (*)(void), void (*)(void), void *);

static int is_program(const char *argv0) {
    const char *base = strrchr(argv0, '/');
    return strcmp(base ? base + 1 : argv0, PROGRAM) == 0;
}

/* arg with every PLACEHOLDER replaced by value, on the heap (NULL when out of memory). */
static char *substitute(const char *arg, const char *value) {
    size_t hole = strlen(PLACEHOLDER), fill = strlen(value), count = 0;
    for (const char *p = strstr(arg, PLACEHOLDER); p; p = strstr(p + hole, PLACEHOLDER))
        count++;
    char *out = malloc(strlen(arg) + count * fill + 1 - count * hole), *w = out;
    if (!out)
        return NULL;
    for (const char *p = arg, *hit; ; p = hit + hole) {
        hit = strstr(p, PLACEHOLDER);
        size_t keep = hit ? (size_t)(hit - p) : strlen(p);
        memcpy(w, p, keep);
        w += keep;
        if (!hit)
            break;
        memcpy(w, value, fill);
        w += fill;
    }
    *w = '\0';
    return out;
}

static void refuse(const char *why) {
    fprintf(stderr, "argv_secret: " PROGRAM " refused to start: %s\n", why);
    exit(2);
}

/* Runs before main: ld.so has set up libc (environment included) by the time _start calls this. */
int __libc_start_main(main_fn main, int argc, char **argv, void (*init)(void), void (*fini)(void),
                      void (*rtld_fini)(void), void *stack_end) {
    start_fn real = (start_fn)dlsym(RTLD_NEXT, "__libc_start_main");
    if (!real) {
        fprintf(stderr, "argv_secret: no __libc_start_main after this library: %s\n", dlerror());
        exit(2);
    }
    if (argc > 0 && argv[0] && is_program(argv[0])) {
        int wanted = 0;
        for (int i = 1; i < argc; i++)
            wanted |= strstr(argv[i], PLACEHOLDER) != NULL;
        char *value = getenv(VARIABLE);
        if (wanted && (!value || !*value))
            refuse(PLACEHOLDER " is in its arguments but " VARIABLE " is not in its environment");
        if (value) {
            char **copy = calloc((size_t)argc + 1, sizeof *copy);
            if (!copy)
                refuse("out of memory");
            for (int i = 0; i < argc; i++) {
                copy[i] = strstr(argv[i], PLACEHOLDER) ? substitute(argv[i], value) : argv[i];
                if (!copy[i])
                    refuse("out of memory");
            }
            /* /proc/PID/environ reads the original environment block, which unsetenv leaves as it was. */
            memset(value, 0, strlen(value));
            unsetenv(VARIABLE);
            argv = copy;
        }
    }
    return real(main, argc, argv, init, fini, rtld_fini, stack_end);
}
