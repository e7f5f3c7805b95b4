/* consumers.serving.native: the reader's page warmer loop (see consumers/serving/reader.py,
 * _Warmer). A reader process maps a table the writer keeps growing; the first read of each
 * new page of the mapping takes a page fault, which a lookup should not pay. A warmer thread
 * reads one byte per page of what the writer has allocated, ahead of the lookups. Doing it
 * from Python meant taking the GIL about a thousand times a second while the table grew, and
 * a warmer preempted while it held the GIL (it runs niced) kept the process's lookups
 * waiting for milliseconds. This loop runs without the GIL until there is something only
 * Python can do (map a new index generation) or a timeout.
 */
#include "native_loops.h"

#ifdef HAVE_MMAN
#include <errno.h>
#include <sys/stat.h>
#include <time.h>

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void sleep_ns(int64_t ns) {
    struct timespec t = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    nanosleep(&t, NULL);
}

/* Bytes of path's file the writer has allocated (tmpfs: blocks in use, at most its size);
 * -errno when it cannot be stat'ed. The writer allocates from the front, but before it
 * collapses a block into a huge page it allocates the block's first page: a read of the
 * block's holes now would put small pages in the way of the collapse, hence a->align. */
static int64_t allocated(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0)
        return -(int64_t)errno;
    int64_t used = (int64_t)st.st_blocks * 512;
    return used < (int64_t)st.st_size ? used : (int64_t)st.st_size;
}

/* A file at path exists and is allocated in full (the writer is done creating it). */
static int complete(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && st.st_size > 0 &&
           (int64_t)st.st_blocks * 512 >= (int64_t)st.st_size;
}

int ds_warm_follow(const WarmArgs *a, int64_t *done, int *err) {
    const volatile uint8_t *p = (const volatile uint8_t *)a->buf;
    int64_t deadline = now_ns() + a->timeout_ns, pause = a->idle_ns;
    uint8_t sink = 0;
    for (;;) {
        if (LOAD(a->gen_word) != a->gen)
            return WARM_GEN;
        if (a->next != NULL && complete(a->next))
            return WARM_NEXT;
        int64_t have = allocated(a->path);
        if (have < 0) {
            *err = (int)-have;
            return have == -ENOENT ? WARM_GONE : WARM_ERROR;
        }
        if (have > a->len)
            have = a->len;
        have -= have % a->align;  /* whole blocks: the writer may be collapsing the last */
        int64_t stop = have < *done + a->step ? have : *done + a->step;
        for (int64_t i = *done; i < stop; i += a->page)
            sink ^= p[i];  /* a read maps the page (a fault now, not in a lookup) */
        int grew = stop > *done;
        if (grew) {
            *done = stop;
            pause = a->busy_ns;
        }
        if (now_ns() >= deadline)
            break;
        if (!grew || stop == have) {  /* caught up: look again after a pause */
            sleep_ns(pause);
            if (!grew)
                pause = a->idle_ns;
        }
    }
    (void)sink;
    return WARM_TIMEOUT;
}
#endif
