/* One background thread per process that runs queued C jobs without the GIL (deltastream's
 * C extensions: the tracker's FIRST-row marking runs there while the training thread goes on).
 *
 *   lane_submit(job)  queue a job (GIL held); -1 when the thread cannot start: run it yourself
 *   lane_finished(job) whether it ran (no wait)
 *   lane_wait(job)    wait until it ran (call without the GIL); while no thread is in a
 *                     job, the caller runs the queued jobs itself, in order, up to its own
 *   lane_hold(on)     keep queued jobs waiting (tests: a job still running when the caller
 *                     goes on); a fork while jobs are held waits for them
 *   lane_busy()       whether another job waits (a long job's run checks it between pieces
 *                     of work and returns 1: it is queued again behind the others)
 *   lane_jobs(out)    jobs finished so far: out[0] by the lane thread, out[1] by waiters
 *
 * Jobs run one at a time, in the order queued; a job whose run returns non-zero goes to the
 * back of the queue and runs on later (a long walk does not hold up short markings). The
 * thread runs at SCHED_IDLE (Linux): on time no other thread of the host wants, so it never
 * preempts the training thread. So it also waits while another process keeps the spare
 * core busy (a publisher's worker process, a broker): a caller that waits for a job the
 * thread has not started runs it on its own core instead — the core it would leave idle
 * while it slept — with the jobs queued before it (one thread in a job at a time, in
 * queue order, whichever thread runs it). A job touches no Python object: it reads and
 * writes memory its submitter keeps alive (Py_buffers held until it is waited for). The
 * thread blocks every signal (Python's handlers run on the main thread) and is started on
 * the first submit. fork(): the prepare handler waits until no job is queued or running, so
 * a child never inherits half-done work; the child starts a thread of its own when it needs
 * one.
 */
#ifndef DELTASTREAM_NATIVE_LANE_H
#define DELTASTREAM_NATIVE_LANE_H

#include <pthread.h>
#include <sched.h>
#include <signal.h>

typedef struct LaneJob {
    int (*run)(struct LaneJob *); /* non-zero: not finished, run again later */
    struct LaneJob *next;
    int done; /* guarded by lane_mu */
} LaneJob;

static pthread_mutex_t lane_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t lane_more = PTHREAD_COND_INITIALIZER; /* a job was queued */
static pthread_cond_t lane_ran = PTHREAD_COND_INITIALIZER;  /* a job finished */
static LaneJob *lane_head = NULL, *lane_tail = NULL;
static int lane_running = 0; /* a thread (the lane's, or a waiter) is in a job */
static int lane_up = 0;      /* the thread exists in this process */
static int lane_atfork = 0;  /* the fork handlers are registered */
static int lane_held = 0;    /* lane_hold */
static int lane_woken = 0;   /* lane_more signalled since the thread last took a job */
static long lane_done_by[2] = {0, 0}; /* jobs finished: by the lane thread, by waiters */

/* Run the job at the head of the queue (lane_mu held, lane_head != NULL, no thread in a
 * job) on the lane thread (waiter 0) or a waiter's; returns with lane_mu held. A job that
 * is not finished goes to the back. */
static void lane_run_head(int waiter) {
    LaneJob *j = lane_head;
    lane_head = j->next;
    if (lane_head == NULL)
        lane_tail = NULL;
    lane_running = 1;
    pthread_mutex_unlock(&lane_mu);
    int again = j->run(j);
    pthread_mutex_lock(&lane_mu);
    lane_running = 0;
    if (again) { /* behind the jobs queued meanwhile */
        j->next = NULL;
        if (lane_tail != NULL)
            lane_tail->next = j;
        else
            lane_head = j;
        lane_tail = j;
        return;
    }
    j->done = 1;
    lane_done_by[waiter]++;
    pthread_cond_broadcast(&lane_ran);
}

static void *lane_main(void *unused) {
    (void)unused;
#if defined(__linux__) && defined(SCHED_IDLE)
    /* The lane only uses time no other thread wants: it never takes a core from the
     * training thread (a wait for one of its jobs frees the waiter's core for it). */
    struct sched_param idle = {.sched_priority = 0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
#endif
    pthread_mutex_lock(&lane_mu);
    for (;;) {
        while (lane_head == NULL || lane_held || lane_running) { /* running: a waiter's */
            lane_woken = 0; /* asleep: the next submit (or a waiter done) wakes it */
            pthread_cond_wait(&lane_more, &lane_mu);
        }
        lane_woken = 0;
        lane_run_head(0);
    }
    return NULL;
}

static void lane_prepare(void) {
    pthread_mutex_lock(&lane_mu);
    while (lane_head != NULL || lane_running)
        pthread_cond_wait(&lane_ran, &lane_mu);
}

static void lane_parent(void) { pthread_mutex_unlock(&lane_mu); }

static void lane_child(void) {
    /* the one thread of the child holds lane_mu; the lane thread was not copied */
    lane_up = 0;
    lane_woken = 0;
    pthread_cond_init(&lane_more, NULL);
    pthread_cond_init(&lane_ran, NULL);
    pthread_mutex_unlock(&lane_mu);
}

static int lane_submit(LaneJob *j) {
    j->next = NULL;
    j->done = 0;
    pthread_mutex_lock(&lane_mu);
    if (!lane_up) {
        if (!lane_atfork) {
            if (pthread_atfork(lane_prepare, lane_parent, lane_child) != 0)
                goto refuse;
            lane_atfork = 1;
        }
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old); /* inherited by the new thread */
        pthread_attr_t at;
        pthread_t t;
        int rc = pthread_attr_init(&at);
        if (rc == 0) {
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            rc = pthread_create(&t, &at, lane_main, NULL);
            pthread_attr_destroy(&at);
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc != 0)
            goto refuse;
#if defined(__linux__)
        /* named here, not by the thread: a thread a loaded host has not run yet is found
         * by its name too (top -H, /proc/<pid>/task) */
        pthread_setname_np(t, "ds-lane");
#endif
        lane_up = 1;
    }
    if (lane_tail != NULL)
        lane_tail->next = j;
    else
        lane_head = j;
    lane_tail = j;
    /* a thread in a job, or already woken, takes this one next: no second wake (a futex
     * call that costs ~10 us on a VM) */
    if (!lane_running && !lane_woken) {
        lane_woken = 1;
        pthread_cond_signal(&lane_more);
    }
    pthread_mutex_unlock(&lane_mu);
    return 0;
refuse:
    pthread_mutex_unlock(&lane_mu);
    return -1;
}

static void lane_hold(int on) {
    pthread_mutex_lock(&lane_mu);
    lane_held = on;
    lane_woken = 0;
    pthread_cond_broadcast(&lane_more);
    pthread_mutex_unlock(&lane_mu);
}

static int lane_busy(void) { /* a hint: read without the lock */
    return __atomic_load_n(&lane_head, __ATOMIC_RELAXED) != NULL;
}

static void lane_jobs(long out[2]) {
    pthread_mutex_lock(&lane_mu);
    out[0] = lane_done_by[0];
    out[1] = lane_done_by[1];
    pthread_mutex_unlock(&lane_mu);
}

static int lane_finished(LaneJob *j) {
    pthread_mutex_lock(&lane_mu);
    int d = j->done;
    pthread_mutex_unlock(&lane_mu);
    return d;
}

static void lane_wait(LaneJob *j) {
    pthread_mutex_lock(&lane_mu);
    int ran = 0;
    while (!j->done) {
        if (!lane_running && !lane_held && lane_head != NULL) {
            lane_run_head(1); /* not started: run it here (and what is queued before it) */
            ran = 1;
        } else {
            pthread_cond_wait(&lane_ran, &lane_mu);
        }
    }
    if (ran && lane_head != NULL && !lane_running) { /* the rest is the lane thread's */
        lane_woken = 1;
        pthread_cond_signal(&lane_more);
    }
    pthread_mutex_unlock(&lane_mu);
}

#endif
