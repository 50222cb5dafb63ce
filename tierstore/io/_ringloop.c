/*
 * tierstore.io._ringloop: the per-I/O turn of a plain io_uring job, in C, without the GIL.
 *
 * One call drives a ring that tierstore.io.ring.Ring set up and fixed to buffer slots
 * (Ring.fix_rw_slots: SQE i reads/writes buffer slot i, its user_data is i). Per turn it queues an
 * I/O in every free slot (the SQE's file offset, and its opcode when given, and the slot in the SQ
 * index array), makes one io_uring_enter(2) that submits them and waits for `wait_nr` completions,
 * stamps the clock once, and logs every completion posted. It is the loop of
 * tierstore.bench.iojobs._ring_clone, the Python reference, with the same I/O order.
 *
 * The ring protocol and memory ordering are those of io_uring(7) and liburing's src/queue.c:
 * the SQ tail is stored with release semantics after the SQE bytes, the CQ tail loaded with acquire
 * semantics before the CQEs, the CQ head stored with release semantics after they are read
 * (__atomic builtins, GCC manual "Built-in Functions for Memory Model Aware Atomic Operations").
 * Struct layouts: linux include/uapi/linux/io_uring.h (struct io_uring_sqe: opcode u8 @0, off u64
 * @8; struct io_uring_cqe: user_data u64 @0, res s32 @8). io_uring_enter is reached through
 * syscall(2) (no liburing). The clock is CLOCK_MONOTONIC, the clock of time.perf_counter_ns on Linux.
 *
 * No numpy C API: arrays arrive through the buffer protocol, held (and so kept alive and unresizable,
 * and the ring's mmaps unclosable) for the whole call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#define IORING_ENTER_GETEVENTS 1u

/* columns of the per-slot state (int64, shape (depth, 5)) */
enum { S_BUSY, S_START, S_OFFSET, S_OPCODE, S_TAG, S_COLS };
/* columns of the completion log (int64, shape (rows, 7)) */
enum { L_START, L_DONE, L_RES, L_OFFSET, L_OPCODE, L_TAG, L_SLOT, L_COLS };
/* why the call returned */
enum { R_MORE = 0, R_DONE = 1, R_ERROR = 2, R_ENTER_FAILED = 3 };

static inline int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

typedef struct {
    Py_buffer sq, cq, sqes, state, offsets, opcodes, tags, log;
    int have_opcodes, have_tags;
} Buffers;

static void release_all(Buffers *b)
{
    Py_buffer *all[] = {&b->sq, &b->cq, &b->sqes, &b->state, &b->offsets, &b->opcodes, &b->tags, &b->log};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        if (all[i]->obj != NULL)
            PyBuffer_Release(all[i]);
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) : PyBUF_C_CONTIGUOUS;
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "_ringloop.run: %s must be a C-contiguous%s buffer", what,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(run_doc,
"run(sq, cq, sqes, fd, layout, state, offsets, opcodes, tags, log, deadline_ns, return_ns, wait_nr, drain)\n"
"--\n\n"
"Drive a ring fixed to slots until its I/Os are issued, a deadline, an error, or ``return_ns``.\n\n"
"sq, cq, sqes: the ring's mmaps (writable buffers); fd: the ring fd; layout: (sq_head, sq_tail,\n"
"sq mask value, sq_array, cq_head, cq_tail, cq mask value, cq_cqes, sq_entries): io_uring_params'\n"
"byte offsets into the mmaps, the two ring masks' values, and sq_entries; state: int64 (depth, 5)\n"
"per-slot [busy, start_ns, offset, opcode, tag],\n"
"kept between calls; offsets: int64 (n,) file offsets to issue in order; opcodes: uint8 (n,) or\n"
"None (keep each SQE's); tags: int64 (n,) or None (0), carried to the log; log: int64 (n + depth, 7)\n"
"[start_ns, done_ns, res, offset, opcode, tag, slot] per completion, in completion order. deadline_ns:\n"
"no I/O is issued at or after it (0: none); return_ns: the call returns, I/Os still in flight,\n"
"after the first turn that ends at or after it (0: none); wait_nr: completions per enter;\n"
"drain: issue nothing, wait for every I/O in flight.\n\n"
"Returns (issued, logged, reason, err_res, err_offset, err_opcode, inflight, enters): reason 0 = the\n"
"offsets are used up or return_ns passed (I/Os may be in flight), 1 = nothing in flight and nothing\n"
"more to issue (deadline, drain), 2 = an I/O failed (err_res = -errno; nothing more issued, the\n"
"rest drained, not logged), 3 = io_uring_enter failed (err_res = -errno; I/Os may be in flight);\n"
"enters: io_uring_enter calls made.");

static PyObject *run(PyObject *self, PyObject *args)
{
    PyObject *o_sq, *o_cq, *o_sqes, *o_state, *o_offsets, *o_opcodes, *o_tags, *o_log;
    int fd, drain;
    unsigned int l_sq_head, l_sq_tail, l_sq_mask, l_sq_array, l_cq_head, l_cq_tail, l_cq_mask, l_cq_cqes,
        l_sq_entries;
    long long deadline_ns, return_ns;
    unsigned int wait_nr;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOi(IIIIIIIII)OOOOOLLIp:run", &o_sq, &o_cq, &o_sqes, &fd, &l_sq_head,
                          &l_sq_tail, &l_sq_mask, &l_sq_array, &l_cq_head, &l_cq_tail, &l_cq_mask, &l_cq_cqes,
                          &l_sq_entries, &o_state, &o_offsets, &o_opcodes, &o_tags, &o_log, &deadline_ns,
                          &return_ns, &wait_nr, &drain))
        return NULL;

    Buffers b;
    memset(&b, 0, sizeof(b));
    if (get_buffer(o_sq, &b.sq, 1, "sq") < 0 || get_buffer(o_cq, &b.cq, 1, "cq") < 0 ||
        get_buffer(o_sqes, &b.sqes, 1, "sqes") < 0 || get_buffer(o_state, &b.state, 1, "state") < 0 ||
        get_buffer(o_offsets, &b.offsets, 0, "offsets") < 0 || get_buffer(o_log, &b.log, 1, "log") < 0)
        goto fail;
    if (o_opcodes != Py_None) {
        if (get_buffer(o_opcodes, &b.opcodes, 0, "opcodes") < 0)
            goto fail;
        b.have_opcodes = 1;
    }
    if (o_tags != Py_None) {
        if (get_buffer(o_tags, &b.tags, 0, "tags") < 0)
            goto fail;
        b.have_tags = 1;
    }

    Py_ssize_t depth = b.state.len / (Py_ssize_t)(S_COLS * sizeof(int64_t));
    Py_ssize_t n = b.offsets.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t log_rows = b.log.len / (Py_ssize_t)(L_COLS * sizeof(int64_t));
    uint32_t cq_mask_v = l_cq_mask;
    if (depth < 1 || b.state.len != depth * (Py_ssize_t)(S_COLS * sizeof(int64_t)) ||
        b.offsets.len != n * (Py_ssize_t)sizeof(int64_t) ||
        (b.have_opcodes && b.opcodes.len != n) ||
        (b.have_tags && b.tags.len != n * (Py_ssize_t)sizeof(int64_t)) ||
        log_rows < n + depth || depth > (Py_ssize_t)l_sq_entries || (Py_ssize_t)depth * 64 > b.sqes.len ||
        (Py_ssize_t)l_sq_array + 4 * (Py_ssize_t)l_sq_entries > b.sq.len ||
        (Py_ssize_t)l_sq_head + 4 > b.sq.len || (Py_ssize_t)l_sq_tail + 4 > b.sq.len ||
        (Py_ssize_t)l_cq_head + 4 > b.cq.len || (Py_ssize_t)l_cq_tail + 4 > b.cq.len ||
        (Py_ssize_t)l_cq_cqes + 16 * ((Py_ssize_t)cq_mask_v + 1) > b.cq.len || wait_nr < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "_ringloop.run: array or ring sizes do not match (state (depth, 5), offsets (n,), "
                        "opcodes/tags (n,) or None, log at least (n + depth, 7), depth <= sq_entries, "
                        "wait_nr >= 1)");
        goto fail;
    }

    char *sq = (char *)b.sq.buf, *cq = (char *)b.cq.buf;
    unsigned char *sqes = (unsigned char *)b.sqes.buf;
    uint32_t *khead = (uint32_t *)(sq + l_sq_head), *ktail = (uint32_t *)(sq + l_sq_tail);
    uint32_t *sq_index = (uint32_t *)(sq + l_sq_array);
    uint32_t *kchead = (uint32_t *)(cq + l_cq_head), *kctail = (uint32_t *)(cq + l_cq_tail);
    const unsigned char *cqes = (const unsigned char *)(cq + l_cq_cqes);
    int64_t *state = (int64_t *)b.state.buf, *logp = (int64_t *)b.log.buf;
    const int64_t *offsets = (const int64_t *)b.offsets.buf;
    const uint8_t *opcodes = b.have_opcodes ? (const uint8_t *)b.opcodes.buf : NULL;
    const int64_t *tags = b.have_tags ? (const int64_t *)b.tags.buf : NULL;

    int32_t *free_slots = (int32_t *)malloc(sizeof(int32_t) * (size_t)depth);
    if (free_slots == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t nfree = 0, inflight = 0;
    for (Py_ssize_t s = depth - 1; s >= 0; s--) {
        if (state[s * S_COLS + S_BUSY])
            inflight++;
        else
            free_slots[nfree++] = (int32_t)s;
    }

    Py_ssize_t next = 0, logged = 0, enters = 0;
    int reason = R_MORE, issuing = !drain, failed = 0;
    long long err_res = 0, err_offset = -1, err_opcode = -1;
    int64_t now = now_ns();

    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        /* queue an I/O in every free slot, unless past the deadline */
        if (issuing && deadline_ns && now >= deadline_ns)
            issuing = 0;
        uint32_t tail = __atomic_load_n(ktail, __ATOMIC_RELAXED);
        uint32_t queued = 0;
        if (issuing && nfree && next < n) {
            int64_t start = now_ns();
            while (nfree && next < n) {
                int32_t s = free_slots[--nfree];
                unsigned char *sqe = sqes + (size_t)s * 64;
                int64_t off = offsets[next];
                memcpy(sqe + 8, &off, 8);
                if (opcodes)
                    sqe[0] = opcodes[next];
                int64_t *st = state + (size_t)s * S_COLS;
                st[S_BUSY] = 1;
                st[S_START] = start;
                st[S_OFFSET] = off;
                st[S_OPCODE] = sqe[0];
                st[S_TAG] = tags ? tags[next] : 0;
                sq_index[(tail + queued) & l_sq_mask] = (uint32_t)s;
                queued++;
                next++;
            }
            __atomic_store_n(ktail, tail + queued, __ATOMIC_RELEASE);  /* after the SQE bytes */
            inflight += queued;
        }
        if (inflight == 0) {   /* issuing here means the offsets are used up */
            reason = failed ? R_ERROR : (issuing ? R_MORE : R_DONE);
            break;
        }
        /* one enter: submit what is queued (also SQEs an earlier EINTR left), wait for wait_nr */
        uint32_t to_submit = (tail + queued) - __atomic_load_n(khead, __ATOMIC_ACQUIRE);
        uint32_t want = (uint32_t)(inflight < (Py_ssize_t)wait_nr ? inflight : wait_nr);
        long r;
        for (;;) {
            enters++;
            r = syscall(__NR_io_uring_enter, fd, to_submit, want, IORING_ENTER_GETEVENTS, NULL, 0);
            if (r >= 0 || errno != EINTR)
                break;
            to_submit = (tail + queued) - __atomic_load_n(khead, __ATOMIC_ACQUIRE);
        }
        if (r < 0) {
            err_res = -errno;
            reason = R_ENTER_FAILED;
            break;
        }
        now = now_ns();
        /* reap every completion posted */
        uint32_t head = *kchead;
        uint32_t ctail = __atomic_load_n(kctail, __ATOMIC_ACQUIRE);  /* before the CQEs */
        while (head != ctail) {
            const unsigned char *cqe = cqes + (size_t)(head & cq_mask_v) * 16;
            uint64_t ud;
            int32_t res;
            memcpy(&ud, cqe, 8);
            memcpy(&res, cqe + 8, 4);
            head++;
            if (ud >= (uint64_t)depth)   /* not one of ours: cannot happen on a ring fixed to slots */
                continue;
            int64_t *st = state + (size_t)ud * S_COLS;
            st[S_BUSY] = 0;
            free_slots[nfree++] = (int32_t)ud;
            inflight--;
            if (failed)
                continue;
            if (res < 0) {
                failed = 1;
                issuing = 0;
                err_res = res;
                err_offset = st[S_OFFSET];
                err_opcode = st[S_OPCODE];
                continue;
            }
            int64_t *row = logp + (size_t)logged * L_COLS;
            row[L_START] = st[S_START];
            row[L_DONE] = now;
            row[L_RES] = res;
            row[L_OFFSET] = st[S_OFFSET];
            row[L_OPCODE] = st[S_OPCODE];
            row[L_TAG] = st[S_TAG];
            row[L_SLOT] = (int64_t)ud;
            logged++;
        }
        __atomic_store_n(kchead, head, __ATOMIC_RELEASE);  /* CQE slots may be reused now */
        if (issuing && !failed && (next >= n || (return_ns && now >= return_ns))) {
            reason = R_MORE;
            break;
        }
    }
    Py_END_ALLOW_THREADS

    free(free_slots);
    release_all(&b);
    return Py_BuildValue("nniLLLnn", next, logged, reason, err_res, err_offset, err_opcode, inflight, enters);

fail:
    release_all(&b);
    return NULL;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, run_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ringloop",
    "The per-I/O turn of tierstore bench's plain io_uring jobs in C, without the GIL (see run).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ringloop(void)
{
    return PyModule_Create(&module);
}
