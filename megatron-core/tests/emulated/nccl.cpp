// The emulated GPU's NCCL (part of device.cpp's library; an empty `libnccl.so` that depends on
// it hands its functions out): the calls megatron-rs makes, between processes on one machine
// (each with its own emulated GPU, as under `mpirun`).
//
// A communicator is a POSIX shared-memory segment named by its unique id (made by
// ncclGetUniqueId, broadcast by the caller as with NCCL), holding a mailbox for every ordered
// pair of members. Every operation is point-to-point chunks through the mailboxes; collectives
// send each member's part to the members that need it and fold the parts in rank order,
// rounding to the element type after each one (what the MPI backend's reference folds do). As
// with NCCL, a call returns at once and runs on a thread of the communicator: the stream it was
// queued on is busy (cuStreamQuery) until it is done, ncclCommGetAsyncError reports a failure,
// and ncclCommAbort stops a call that waits for a member that never comes.
#include <fcntl.h>
#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <random>

namespace emu::nccl {

using Result = int;
constexpr Result SUCCESS = 0, SYSTEM_ERROR = 2, INVALID_ARGUMENT = 4, INVALID_USAGE = 5,
                 REMOTE_ERROR = 6;

struct UniqueId {
    char internal[128];
};

// Bytes a mailbox carries at a time.
constexpr std::size_t CHUNK = 64 * 1024;

// One direction between two members: a chunk in flight when `written` is ahead of `read`.
struct Mailbox {
    std::atomic<std::uint64_t> written, read;
    std::uint64_t bytes;
    unsigned char data[CHUNK];
};

// The shared segment: how many members have joined, then the n × n mailboxes (from, to).
struct Segment {
    std::atomic<int> joined;
    Mailbox boxes[1];
};

std::size_t segment_bytes(int n) {
    return offsetof(Segment, boxes) + sizeof(Mailbox) * (std::size_t)n * (std::size_t)n;
}

// One point-to-point transfer of a call: to or from `peer`.
struct Transfer {
    bool send;
    int peer;
    unsigned char* data;
    std::size_t bytes, done = 0;
};

struct Comm {
    Segment* segment = nullptr;
    int rank = 0, size = 0;
    std::atomic<bool> aborted{false};
    std::atomic<Result> error{SUCCESS};
    // The calls queued for the communicator's thread, in order.
    std::mutex lock;
    std::condition_variable wake;
    std::deque<std::function<Result()>> calls;
    bool closing = false;
    std::thread worker;

    Mailbox& box(int from, int to) { return segment->boxes[from * size + to]; }
};

// Moves every transfer's chunks until all are done; REMOTE_ERROR if the communicator is aborted
// first.
Result exchange(Comm& c, std::vector<Transfer>& transfers) {
    for (;;) {
        bool pending = false, moved = false;
        for (std::size_t i = 0; i < transfers.size(); ++i) {
            Transfer& t = transfers[i];
            if (t.done == t.bytes) continue;
            pending = true;
            // Transfers between the same two members in the same direction go in order.
            bool behind = false;
            for (std::size_t j = 0; j < i && !behind; ++j) {
                const Transfer& u = transfers[j];
                behind = u.send == t.send && u.peer == t.peer && u.done < u.bytes;
            }
            if (behind) continue;
            Mailbox& b = t.send ? c.box(c.rank, t.peer) : c.box(t.peer, c.rank);
            const std::uint64_t written = b.written.load(std::memory_order_acquire);
            const std::uint64_t read = b.read.load(std::memory_order_acquire);
            if (t.send && written == read) {
                const std::size_t n = std::min(CHUNK, t.bytes - t.done);
                std::memcpy(b.data, t.data + t.done, n);
                b.bytes = n;
                b.written.store(written + 1, std::memory_order_release);
                t.done += n;
                moved = true;
            } else if (!t.send && written > read) {
                const std::size_t n = b.bytes;
                if (n > t.bytes - t.done) return INVALID_USAGE;  // more than this receive holds
                std::memcpy(t.data + t.done, b.data, n);
                b.read.store(read + 1, std::memory_order_release);
                t.done += n;
                moved = true;
            }
        }
        if (!pending) return SUCCESS;
        if (c.aborted.load()) return REMOTE_ERROR;
        if (!moved) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
}

std::size_t element_size(int type) {
    switch (type) {
        case 0: case 1: return 1;                  // int8, uint8
        case 2: case 3: return 4;                  // int32, uint32
        case 4: case 5: case 8: return 8;          // int64, uint64, float64
        case 6: case 9: return 2;                  // float16, bfloat16
        case 7: return 4;                          // float32
        default: return 0;
    }
}

// acc = acc (op) x for `count` elements of `type`, rounded to the type.
void fold(void* acc, const void* x, std::size_t count, int type, int op) {
    auto apply = [op](auto a, auto b) -> decltype(a) {
        switch (op) {
            case 2: return a > b ? a : b;
            case 3: return a < b ? a : b;
            case 1: return static_cast<decltype(a)>(a * b);
            default: return static_cast<decltype(a)>(a + b);
        }
    };
    auto each = [&](auto* a, const auto* b) {
        for (std::size_t i = 0; i < count; ++i) a[i] = apply(a[i], b[i]);
    };
    auto each16 = [&](std::uint16_t* a, const std::uint16_t* b, bool brain) {
        for (std::size_t i = 0; i < count; ++i) {
            const float u = brain ? bf16_to_f32(a[i]) : f16_to_f32(a[i]);
            const float v = brain ? bf16_to_f32(b[i]) : f16_to_f32(b[i]);
            const float r = apply(u, v);
            a[i] = brain ? f32_to_bf16(r) : f32_to_f16(r);
        }
    };
    switch (type) {
        case 0: each(static_cast<std::int8_t*>(acc), static_cast<const std::int8_t*>(x)); break;
        case 1: each(static_cast<std::uint8_t*>(acc), static_cast<const std::uint8_t*>(x)); break;
        case 2: each(static_cast<std::int32_t*>(acc), static_cast<const std::int32_t*>(x)); break;
        case 3: each(static_cast<std::uint32_t*>(acc), static_cast<const std::uint32_t*>(x)); break;
        case 4: each(static_cast<std::int64_t*>(acc), static_cast<const std::int64_t*>(x)); break;
        case 5: each(static_cast<std::uint64_t*>(acc), static_cast<const std::uint64_t*>(x)); break;
        case 6:
            each16(static_cast<std::uint16_t*>(acc), static_cast<const std::uint16_t*>(x), false);
            break;
        case 7: each(static_cast<float*>(acc), static_cast<const float*>(x)); break;
        case 8: each(static_cast<double*>(acc), static_cast<const double*>(x)); break;
        case 9:
            each16(static_cast<std::uint16_t*>(acc), static_cast<const std::uint16_t*>(x), true);
            break;
    }
}

// Sends each member p this member's `count` elements at `part_for(p)` and folds, in rank
// order, what every member sent this one (its own part included) into `out` (which may overlap
// the parts: they are read before it is written).
Result fold_from_all(Comm& c, const std::function<const unsigned char*(int)>& part_for,
                     unsigned char* out, std::size_t count, int type, int op) {
    const std::size_t bytes = count * element_size(type);
    std::vector<std::vector<unsigned char>> parts(c.size, std::vector<unsigned char>(bytes));
    std::vector<Transfer> transfers;
    for (int p = 0; p < c.size; ++p) {
        if (p == c.rank || bytes == 0) continue;
        transfers.push_back({true, p, const_cast<unsigned char*>(part_for(p)), bytes});
        transfers.push_back({false, p, parts[p].data(), bytes});
    }
    std::memcpy(parts[c.rank].data(), part_for(c.rank), bytes);
    if (const Result r = exchange(c, transfers); r != SUCCESS) return r;
    for (int p = 1; p < c.size; ++p) fold(parts[0].data(), parts[p].data(), count, type, op);
    std::memcpy(out, parts[0].data(), bytes);
    return SUCCESS;
}

// Queues `call` (which touches `buffers`) on the communicator's thread and marks `stream` busy
// until it has run; INVALID_USAGE when the stream-order check finds the buffers' other uses
// unordered with it.
Result enqueue(Comm* c, void* stream, std::function<Result()> call,
               const std::vector<Access>& buffers) {
    if (!c) return INVALID_ARGUMENT;
    if (auto* s = static_cast<Stream*>(stream); s && s->capturing) {
        // Captured into a graph: each replay runs the call on the communicator's thread (the
        // members replay their graphs in the same order) and the graph's next work waits for it.
        s->captured.push_back([c, call, buffers]() -> CUresult {
            if (!check_order("an NCCL call", buffers)) return LAUNCH_FAILED;
            auto done = std::make_shared<Pending>();
            auto result = std::make_shared<std::atomic<Result>>(SUCCESS);
            {
                const std::lock_guard<std::mutex> guard(c->lock);
                c->calls.push_back([call, done, result]() {
                    const Result r = call();
                    result->store(r);
                    done->done.store(true, std::memory_order_release);
                    return r;
                });
            }
            c->wake.notify_one();
            while (!done->done.load(std::memory_order_acquire)) {
                std::this_thread::sleep_for(std::chrono::microseconds(20));
            }
            return result->load() == SUCCESS ? OK : LAUNCH_FAILED;
        });
        return SUCCESS;
    }
    {
        const Executing on(stream);
        if (!check_order("an NCCL call", buffers)) return INVALID_USAGE;
    }
    auto pending = std::make_shared<Pending>();
    if (auto* s = static_cast<Stream*>(stream)) {
        // Work queued on the stream before the call runs before it.
        wait_pending(s);
        s->pending.push_back(pending);
    }
    {
        const std::lock_guard<std::mutex> guard(c->lock);
        c->calls.push_back([call = std::move(call), pending]() {
            const Result r = call();
            pending->done.store(true, std::memory_order_release);
            return r;
        });
    }
    c->wake.notify_one();
    return SUCCESS;
}

void serve(Comm* c) {
    for (;;) {
        std::function<Result()> call;
        {
            std::unique_lock<std::mutex> guard(c->lock);
            c->wake.wait(guard, [c] { return c->closing || !c->calls.empty(); });
            if (c->calls.empty()) return;
            call = std::move(c->calls.front());
            c->calls.pop_front();
        }
        if (const Result r = call(); r != SUCCESS) {
            Result expected = SUCCESS;
            c->error.compare_exchange_strong(expected, r);
        }
    }
}

// The point-to-point transfers of the open group (ncclGroupStart .. ncclGroupEnd) of this
// thread, by communicator and stream.
struct Grouped {
    Comm* comm;
    void* stream;
    std::vector<Transfer> transfers;
};
thread_local int group_depth = 0;
thread_local std::vector<Grouped> grouped;

Result transfer(Comm* c, void* stream, Transfer t) {
    if (!c || t.peer < 0 || t.peer >= c->size) return INVALID_ARGUMENT;
    if (t.bytes == 0) return SUCCESS;
    if (group_depth > 0) {
        for (Grouped& g : grouped) {
            if (g.comm == c && g.stream == stream) {
                g.transfers.push_back(t);
                return SUCCESS;
            }
        }
        grouped.push_back({c, stream, {t}});
        return SUCCESS;
    }
    return enqueue(
        c, stream,
        [c, t]() mutable {
            std::vector<Transfer> one{t};
            return exchange(*c, one);
        },
        {{t.data, !t.send}});
}

}  // namespace emu::nccl

using namespace emu::nccl;

#pragma GCC visibility push(default)
extern "C" {

Result ncclGetVersion(int* version) {
    *version = 23000;
    return SUCCESS;
}

Result ncclGetUniqueId(UniqueId* id) {
    static std::atomic<unsigned> made{0};
    std::random_device random;
    std::memset(id->internal, 0, sizeof id->internal);
    std::snprintf(id->internal, sizeof id->internal, "/megatron-emulated-nccl-%d-%u-%08x",
                  (int)getpid(), made.fetch_add(1), random());
    return SUCCESS;
}

Result ncclCommInitRank(Comm** out, int nranks, UniqueId id, int rank) {
    if (nranks < 1 || rank < 0 || rank >= nranks) return INVALID_ARGUMENT;
    char name[129];
    std::memcpy(name, id.internal, 128);
    name[128] = 0;
    const int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
    if (fd < 0) return SYSTEM_ERROR;
    const std::size_t bytes = segment_bytes(nranks);
    // Every member sizes it alike; the pages start zeroed (every counter 0).
    if (ftruncate(fd, (off_t)bytes) != 0) {
        close(fd);
        return SYSTEM_ERROR;
    }
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return SYSTEM_ERROR;
    auto* c = new Comm;
    c->segment = static_cast<Segment*>(m);
    c->rank = rank;
    c->size = nranks;
    // Wait (at most two minutes, where NCCL would wait for ever) for every member to join,
    // then the name is no longer needed.
    c->segment->joined.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
    while (c->segment->joined.load() < nranks) {
        if (std::chrono::steady_clock::now() > deadline) {
            munmap(m, bytes);
            delete c;
            return SYSTEM_ERROR;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (rank == 0) shm_unlink(name);
    c->worker = std::thread(serve, c);
    *out = c;
    return SUCCESS;
}

Result ncclCommDestroy(Comm* c) {
    if (!c) return INVALID_ARGUMENT;
    {
        const std::lock_guard<std::mutex> guard(c->lock);
        c->closing = true;
    }
    c->wake.notify_one();
    c->worker.join();
    munmap(c->segment, segment_bytes(c->size));
    delete c;
    return SUCCESS;
}

Result ncclCommAbort(Comm* c) {
    if (!c) return INVALID_ARGUMENT;
    c->aborted.store(true);
    {
        const std::lock_guard<std::mutex> guard(c->lock);
        c->calls.clear();
    }
    return ncclCommDestroy(c);
}

Result ncclCommGetAsyncError(Comm* c, Result* state) {
    if (!c) return INVALID_ARGUMENT;
    *state = c->error.load();
    return SUCCESS;
}

Result ncclCommCount(const Comm* c, int* count) {
    *count = c->size;
    return SUCCESS;
}

Result ncclCommUserRank(const Comm* c, int* rank) {
    *rank = c->rank;
    return SUCCESS;
}

Result ncclGroupStart() {
    ++group_depth;
    return SUCCESS;
}

Result ncclGroupEnd() {
    if (group_depth == 0) return INVALID_USAGE;
    if (--group_depth > 0) return SUCCESS;
    std::vector<Grouped> groups = std::move(grouped);
    grouped.clear();
    for (Grouped& g : groups) {
        Comm* c = g.comm;
        std::vector<Access> buffers;
        for (const Transfer& t : g.transfers) buffers.push_back({t.data, !t.send});
        const Result r = enqueue(
            c, g.stream,
            [c, transfers = std::move(g.transfers)]() mutable { return exchange(*c, transfers); },
            buffers);
        if (r != SUCCESS) return r;
    }
    return SUCCESS;
}

Result ncclSend(const void* data, std::size_t count, int type, int peer, Comm* c, void* stream) {
    const std::size_t size = element_size(type);
    if (size == 0) return INVALID_ARGUMENT;
    return transfer(c, stream,
                    {true, peer, (unsigned char*)const_cast<void*>(data), count * size});
}

Result ncclRecv(void* data, std::size_t count, int type, int peer, Comm* c, void* stream) {
    const std::size_t size = element_size(type);
    if (size == 0) return INVALID_ARGUMENT;
    return transfer(c, stream, {false, peer, static_cast<unsigned char*>(data), count * size});
}

Result ncclAllReduce(const void* send, void* recv, std::size_t count, int type, int op, Comm* c,
                     void* stream) {
    if (!c || element_size(type) == 0) return INVALID_ARGUMENT;
    const auto* mine = static_cast<const unsigned char*>(send);
    return enqueue(
        c, stream,
        [=]() {
            return fold_from_all(*c, [mine](int) { return mine; },
                                 static_cast<unsigned char*>(recv), count, type, op);
        },
        {{send, false, count * element_size(type)}, {recv, true, count * element_size(type)}});
}

Result ncclReduceScatter(const void* send, void* recv, std::size_t count, int type, int op,
                         Comm* c, void* stream) {
    const std::size_t bytes = count * element_size(type);
    if (!c || element_size(type) == 0) return INVALID_ARGUMENT;
    const auto* whole = static_cast<const unsigned char*>(send);
    return enqueue(
        c, stream,
        [=]() {
            return fold_from_all(*c, [whole, bytes](int p) { return whole + p * bytes; },
                                 static_cast<unsigned char*>(recv), count, type, op);
        },
        {{send, false, c->size * bytes}, {recv, true, bytes}});
}

Result ncclAllGather(const void* send, void* recv, std::size_t count, int type, Comm* c,
                     void* stream) {
    const std::size_t bytes = count * element_size(type);
    if (!c || element_size(type) == 0) return INVALID_ARGUMENT;
    return enqueue(c, stream, [=]() {
        auto* out = static_cast<unsigned char*>(recv);
        std::vector<Transfer> transfers;
        for (int p = 0; p < c->size; ++p) {
            if (p == c->rank || bytes == 0) continue;
            transfers.push_back({true, p, (unsigned char*)send, bytes});
            transfers.push_back({false, p, out + p * bytes, bytes});
        }
        if (const Result r = exchange(*c, transfers); r != SUCCESS) return r;
        std::memmove(out + c->rank * bytes, send, bytes);
        return SUCCESS;
    }, {{send, false, bytes}, {recv, true, c->size * bytes}});
}

Result ncclBroadcast(const void* send, void* recv, std::size_t count, int type, int root,
                     Comm* c, void* stream) {
    const std::size_t bytes = count * element_size(type);
    if (!c || element_size(type) == 0 || root < 0 || root >= c->size) return INVALID_ARGUMENT;
    return enqueue(c, stream, [=]() {
        std::vector<Transfer> transfers;
        if (c->rank == root) {
            for (int p = 0; p < c->size; ++p) {
                if (p != root && bytes > 0) {
                    transfers.push_back({true, p, (unsigned char*)send, bytes});
                }
            }
        } else if (bytes > 0) {
            transfers.push_back({false, root, static_cast<unsigned char*>(recv), bytes});
        }
        if (const Result r = exchange(*c, transfers); r != SUCCESS) return r;
        if (c->rank == root && send != recv) std::memmove(recv, send, bytes);
        return SUCCESS;
    }, {{send, false}, {recv, true}});
}

}  // extern "C"
#pragma GCC visibility pop
