// An emulated GPU for tests on machines without one: the part of the CUDA driver API and of
// cuBLAS that megatron-rs calls (through cudarc), implemented on the CPU, with the kernels' own
// CUDA C run by the emulation of launch.cpp. Built as `libcuda.so` (whose cuBLAS functions an
// empty `libcublas.so` that depends on it hands out, see device.rs); kernels are compiled by the
// real NVRTC, and their PTX tells each kernel's thread limit.
//
// What it models: device memory is host memory (each allocation ends at an unmapped page, so a
// kernel reading or writing past a buffer stops the process with the buffer named, as
// compute-sanitizer's memcheck would); streams run their work at once, in the order it is queued
// (a valid order of any CUDA program that orders its streams with events), and every buffer a
// kernel, copy, product or NCCL call touches is checked to be ordered after the other streams'
// conflicting uses of it (vector clocks over streams, joined by event waits and host
// synchronisations: a use on two streams that nothing orders fails, as it is a race on a GPU;
// the host's synchronisations count for every thread, so some races between threads are
// missed, none is reported that is not one); a stream being captured records its work into a
// graph instead, replayed by cuGraphLaunch; launches are checked against Hopper's limits
// (threads per block, the kernel's `.maxntid`, grid sizes, dynamic shared memory against what
// cuFuncSetAttribute allowed), and a kernel that races on shared memory or deadlocks at a
// barrier fails its launch with CUDA_ERROR_LAUNCH_FAILED and a report on stderr.
#include "launch.cpp"

#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <map>
#include <thread>

namespace emu {

using CUresult = int;
constexpr CUresult OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, INVALID_DEVICE = 101,
                   INVALID_IMAGE = 200, INVALID_HANDLE = 400, NOT_FOUND = 500,
                   LAUNCH_OUT_OF_RESOURCES = 701, LAUNCH_FAILED = 719, NOT_SUPPORTED = 801,
                   INVALID_PTX = 218, CAPTURE_UNSUPPORTED = 900;

// Hopper (H100 SXM) as the kernels see it.
constexpr int SMS = 132, MAX_THREADS = 1024, DEFAULT_SHARED = 48 * 1024,
              MAX_SHARED_OPTIN = 227 * 1024;
constexpr unsigned long long TOTAL_MEMORY = 80ull << 30;

// One work item of a stream: runs it, or returns why not.
using Work = std::function<CUresult()>;

// Work another thread does for a stream (an emulated NCCL call): the stream's later work waits
// for it, and cuStreamQuery reports the stream busy until it is done.
struct Pending {
    std::atomic<bool> done{false};
};

// What a stream (or the host) has waited for: per stream, the last of its operations ordered
// before (a vector clock; stream ids start at 1).
struct Clock {
    std::vector<std::uint64_t> t;
    std::uint64_t at(unsigned stream) const { return stream < t.size() ? t[stream] : 0; }
    void join(const Clock& other) {
        if (t.size() < other.t.size()) t.resize(other.t.size());
        for (std::size_t i = 0; i < other.t.size(); ++i) t[i] = std::max(t[i], other.t[i]);
    }
    std::uint64_t tick(unsigned stream) {
        if (t.size() <= stream) t.resize(stream + 1);
        return ++t[stream];
    }
};

struct Stream {
    bool capturing = false;
    std::vector<Work> captured;
    std::vector<std::shared_ptr<Pending>> pending;
    unsigned id = 0;
    Clock clock;
};

// Waits for the work other threads do for `s`.
void wait_pending(Stream* s) {
    if (!s) return;
    for (const auto& p : s->pending) {
        while (!p->done.load(std::memory_order_acquire)) {
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }
    s->pending.clear();
}
struct Graph {
    std::vector<Work> work;
};
struct Event {
    double ms = 0;
    // The recording stream's clock when it ran the record.
    Clock clock;
};
struct Function {
    const EmuKernel* kernel;
    // The PTX's `.maxntid` product (threads per block the kernel is compiled for), 0 if none.
    unsigned max_threads = 0;
    int max_dynamic_shared = DEFAULT_SHARED;
};
struct Module {
    std::map<std::string, Function> functions;
    std::map<std::string, unsigned> max_threads;
};

// One stream's operation on a buffer: which stream, its clock then, and the bytes it touched:
// `lo..hi` when they are known (`ranged`: a collective on one bucket of a flat buffer), else
// only where it starts (`lo`: a kernel's pointer argument).
struct Use {
    unsigned stream = 0;
    std::uint64_t time = 0;
    unsigned long long lo = 0, hi = 0;
    bool ranged = false;
    // The operation, for the report.
    const char* what = "";
};

// Whether two uses of one allocation may touch the same bytes. Two uses of unknown extent may
// (the whole allocation, as far as either knows); against a use of known bytes, a use of
// unknown extent counts by where it starts. That finds a kernel writing a parameter's
// gradient while a collective reduces the bucket that holds it, and lets kernels work on the
// rest of a flat buffer while a collective runs on one of its buckets, as Megatron-LM's
// overlapped reductions do (a kernel starting before a bucket and running into it is missed).
bool overlap(const Use& a, const Use& b) {
    if (!a.ranged && !b.ranged) return true;
    return a.lo < b.hi && b.lo < a.hi;
}

// Whether `later` touches every byte `earlier` did (a write that replaces it in the record).
bool covers(const Use& later, const Use& earlier) {
    return !later.ranged || (earlier.ranged && later.lo <= earlier.lo && earlier.hi <= later.hi);
}

// Every allocation: where its mapping starts and how long it is, and its size; the writes to
// it and the reads since that later uses must be ordered after, for the stream-order check.
struct Allocation {
    void* mapping;
    std::size_t mapped, bytes;
    std::vector<Use> writes;
    std::vector<Use> reads;
};
// Guards the allocations, their uses and every clock.
std::mutex memory_lock;
std::map<unsigned long long, Allocation> allocations;
// What the host has waited for (stream and event synchronisations): work it ordered before
// later work on any stream.
Clock synced;
unsigned streams_made = 0;
unsigned long long used_bytes = 0, used_high = 0;
// The kernel this thread runs now, for the fault handler's message.
thread_local const char* running_kernel = nullptr;

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// The stream whose work this thread runs now (null: the host's synchronous calls).
thread_local Stream* executing = nullptr;

// A buffer one operation reads or writes: where (any address inside it), and how many bytes
// from there when known (0: not known).
struct Access {
    const void* at;
    bool write;
    std::size_t bytes = 0;
};

// Makes `stream` the one whose work this thread runs, for its lifetime.
class Executing {
  public:
    explicit Executing(void* stream) : outer_(executing) {
        executing = static_cast<Stream*>(stream);
    }
    ~Executing() { executing = outer_; }
    Executing(const Executing&) = delete;
    Executing& operator=(const Executing&) = delete;

  private:
    Stream* outer_;
};

// What this host thread asked of the device (a rank's thread, so that ranks and concurrent
// tests do not mix): operations it queued itself (kernel launches, copies, products,
// collectives and graph launches; not the work a graph replays), the kernels it ran (replayed
// or not), its graph launches, and the bytes its copies moved from the host to the device and
// back. Read with megatron_emu_launches().
thread_local unsigned long long host_ops = 0, kernels_run = 0, graph_launches = 0;
thread_local unsigned long long bytes_to_device = 0, bytes_to_host = 0;

CUresult run_or_capture(void* stream, Work work) {
    auto* s = static_cast<Stream*>(stream);
    if (s && s->capturing) {
        s->captured.push_back(std::move(work));
        return OK;
    }
    ++host_ops;
    wait_pending(s);
    Executing on(s);
    return work();
}

// The allocation `at` lies in, or the end of `allocations` (under memory_lock).
std::map<unsigned long long, Allocation>::iterator allocation_of(const void* at) {
    const auto addr = reinterpret_cast<unsigned long long>(at);
    auto it = allocations.upper_bound(addr);
    if (it == allocations.begin()) return allocations.end();
    --it;
    return addr < it->first + std::max<std::size_t>(it->second.bytes, 1) ? it
                                                                          : allocations.end();
}

// The pointers in the device buffer that `table` starts (as many as the rest of it holds).
std::vector<const void*> pointer_table(const void* table) {
    const std::lock_guard<std::mutex> lock(memory_lock);
    const auto it = allocation_of(table);
    if (it == allocations.end()) return {};
    const auto addr = reinterpret_cast<unsigned long long>(table);
    const std::size_t n = (it->first + it->second.bytes - addr) / sizeof(void*);
    const auto* entries = static_cast<const void* const*>(table);
    return {entries, entries + n};
}

// Checks that the running stream's operation `what` (one clock tick) is ordered after every
// other stream's use of the buffers it touches that conflicts with it (a write and any use),
// as an event the stream waited for or a host synchronisation orders them, and records its
// uses; reports the first unordered pair on stderr and returns false. A GPU would run them in
// either order. Buffers are found by any address inside them; other addresses are ignored.
bool check_order(const char* what, const std::vector<Access>& accesses) {
    Stream* s = executing;
    if (!s) return true;
    const std::lock_guard<std::mutex> lock(memory_lock);
    const std::uint64_t time = s->clock.tick(s->id);
    auto ordered = [&](const Use& u) {
        return u.stream == 0 || u.stream == s->id || s->clock.at(u.stream) >= u.time ||
               synced.at(u.stream) >= u.time;
    };
    for (const Access& a : accesses) {
        const auto it = allocation_of(a.at);
        if (it == allocations.end()) continue;
        Allocation& alloc = it->second;
        const auto lo = reinterpret_cast<unsigned long long>(a.at);
        const Use now{s->id, time, lo, lo + std::max<std::size_t>(a.bytes, 1), a.bytes > 0, what};
        const Use* conflict = nullptr;
        const char* earlier = "written";
        for (const Use& w : alloc.writes) {
            if (!conflict && !ordered(w) && overlap(now, w)) conflict = &w;
        }
        for (const Use& r : alloc.reads) {
            if (a.write && !conflict && !ordered(r) && overlap(now, r)) {
                conflict = &r;
                earlier = "read";
            }
        }
        if (conflict) {
            std::fprintf(stderr,
                         "emulated GPU: %s on stream %u %s the %zu-byte device buffer at 0x%llx "
                         "(bytes %llu to %llu), %s by %s on stream %u (bytes %llu to %llu) with "
                         "nothing ordering the two (an event recorded after it and waited for, "
                         "or a synchronisation): a GPU may run them in either order\n",
                         what, s->id, a.write ? "writes" : "reads", alloc.bytes, it->first,
                         now.lo - it->first, now.hi - it->first, earlier, conflict->what,
                         conflict->stream, conflict->lo - it->first, conflict->hi - it->first);
            return false;
        }
        auto replaced = [&](const Use& u) { return ordered(u) && covers(now, u); };
        if (a.write) {
            std::erase_if(alloc.writes, replaced);
            std::erase_if(alloc.reads, replaced);
            alloc.writes.push_back(now);
        } else {
            std::erase_if(alloc.reads, [&](const Use& r) {
                return r.stream == s->id && covers(now, r);
            });
            alloc.reads.push_back(now);
        }
    }
    return true;
}

// A device allocation of `bytes`: 256-byte aligned, ending as close to an unmapped page as the
// alignment allows.
unsigned long long allocate(std::size_t bytes) {
    const std::size_t page = (std::size_t)sysconf(_SC_PAGESIZE);
    const std::size_t rounded = (bytes + 255) / 256 * 256;
    const std::size_t data_pages = (rounded + page - 1) / page * page;
    const std::size_t mapped = data_pages + page;
    void* m = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return 0;
    char* guard = static_cast<char*>(m) + data_pages;
    mprotect(guard, page, PROT_NONE);
    // Fresh device memory is not zero on a GPU: fill with a pattern that reads as NaN in f32.
    char* data = guard - rounded;
    std::memset(static_cast<char*>(m), 0xff, data_pages);
    const auto ptr = reinterpret_cast<unsigned long long>(data);
    const std::lock_guard<std::mutex> lock(memory_lock);
    allocations[ptr] = {m, mapped, bytes, {}, {}};
    used_bytes += bytes;
    used_high = std::max(used_high, used_bytes);
    return ptr;
}

CUresult release(unsigned long long ptr) {
    if (ptr == 0) return OK;
    const std::lock_guard<std::mutex> lock(memory_lock);
    const auto it = allocations.find(ptr);
    if (it == allocations.end()) return INVALID_VALUE;
    munmap(it->second.mapping, it->second.mapped);
    used_bytes -= it->second.bytes;
    allocations.erase(it);
    return OK;
}

// Writes into `text` which allocation an address lies in or just past (for the fault handler:
// no allocation, little stack).
void describe(const void* address, char* text, std::size_t size) {
    const auto a = reinterpret_cast<unsigned long long>(address);
    for (const auto& [ptr, alloc] : allocations) {
        const auto begin = reinterpret_cast<unsigned long long>(alloc.mapping);
        if (a >= begin && a < begin + alloc.mapped) {
            std::snprintf(text, size,
                          "%lld bytes from the start of a %zu-byte device buffer at 0x%llx",
                          (long long)(a - ptr), alloc.bytes, ptr);
            return;
        }
    }
    std::snprintf(text, size, "in no device buffer");
}

void on_fault(int, siginfo_t* info, void*) {
    // The process ends here; say where, formatting into static buffers (the handler may run on
    // a small alternate stack) and writing with one system call.
    static char where[192], message[512];
    describe(info->si_addr, where, sizeof where);
    const int n = std::snprintf(
        message, sizeof message,
        "emulated GPU: kernel %s accessed address %p (%s): an out-of-bounds access "
        "(CUDA_ERROR_ILLEGAL_ADDRESS on a GPU)\n",
        running_kernel ? running_kernel : "(none: host code)", info->si_addr, where);
    if (n > 0) {
        const ssize_t written = write(2, message, std::min<std::size_t>(n, sizeof message - 1));
        (void)written;
    }
    std::abort();
}

void install_fault_handler() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa {};
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigaction(SIGSEGV, &sa, nullptr);
        sigaction(SIGBUS, &sa, nullptr);
    });
}

// Each `.entry name` of a PTX text with the product of its `.maxntid` (0 when it has none).
std::map<std::string, unsigned> entries(const std::string& ptx) {
    std::map<std::string, unsigned> out;
    std::size_t at = 0;
    while ((at = ptx.find(".entry ", at)) != std::string::npos) {
        at += 7;
        std::size_t end = ptx.find_first_of("( \n", at);
        const std::string name = ptx.substr(at, end - at);
        unsigned threads = 0;
        const std::size_t next = ptx.find(".entry ", at);
        const std::size_t body = ptx.find('{', at);
        const std::size_t maxntid = ptx.find(".maxntid", at);
        if (maxntid != std::string::npos && maxntid < body && maxntid < next) {
            unsigned x = 1, y = 1, z = 1;
            const int n = std::sscanf(ptx.c_str() + maxntid, ".maxntid %u, %u, %u", &x, &y, &z);
            if (n >= 1) threads = x * (n >= 2 ? y : 1) * (n >= 3 ? z : 1);
        }
        out[name] = threads;
    }
    return out;
}

// A launch of `f` with `params` (pointers to the arguments, cuLaunchKernel's convention),
// checked against the device's limits, its arguments copied (so that a graph can replay it).
CUresult launch(Function* f, const unsigned grid[3], const unsigned block[3], unsigned shared,
                void* stream, void** params) {
    const unsigned threads = block[0] * block[1] * block[2];
    const char* name = f->kernel->name;
    auto refuse = [&](CUresult code, const std::string& why) {
        std::fprintf(stderr, "emulated GPU: launch of %s refused: %s\n", name, why.c_str());
        return code;
    };
    if (threads == 0 || grid[0] * grid[1] * grid[2] == 0) {
        return refuse(INVALID_VALUE, "an empty grid or block");
    }
    if (threads > MAX_THREADS || block[0] > 1024 || block[1] > 1024 || block[2] > 64) {
        return refuse(INVALID_VALUE, "block of " + std::to_string(threads) + " threads");
    }
    if (f->max_threads && threads > f->max_threads) {
        return refuse(INVALID_VALUE, std::to_string(threads) +
                                         " threads per block, more than its __launch_bounds__ (" +
                                         std::to_string(f->max_threads) + ")");
    }
    if (grid[1] > 65535 || grid[2] > 65535 || grid[0] > 0x7fffffffu) {
        return refuse(INVALID_VALUE, "grid (" + std::to_string(grid[0]) + ", " +
                                         std::to_string(grid[1]) + ", " +
                                         std::to_string(grid[2]) + ")");
    }
    if ((int)shared > f->max_dynamic_shared) {
        return refuse(INVALID_VALUE,
                      std::to_string(shared) + " bytes of dynamic shared memory, more than the " +
                          std::to_string(f->max_dynamic_shared) +
                          " its CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES allows");
    }
    if (shared > sizeof emu_dynamic_shared) {
        return refuse(LAUNCH_OUT_OF_RESOURCES, std::to_string(shared) + " bytes of shared memory");
    }
    const std::vector<std::size_t> sizes = f->kernel->param_sizes();
    std::vector<std::vector<unsigned char>> args;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
        const auto* p = static_cast<const unsigned char*>(params[i]);
        args.emplace_back(p, p + sizes[i]);
    }
    const EmuKernel* kernel = f->kernel;
    const std::array<unsigned, 3> g{grid[0], grid[1], grid[2]}, b{block[0], block[1], block[2]};
    return run_or_capture(stream, [kernel, g, b, args = std::move(args)]() mutable {
        ++kernels_run;
        std::vector<void*> pointers;
        for (auto& a : args) pointers.push_back(a.data());
        const std::vector<int> kinds = kernel->param_kinds();
        for (std::size_t i = 0; i < kinds.size(); ++i) {
            if (kinds[i] == 0) continue;
            const void* p = *static_cast<void* const*>(pointers[i]);
            if (!check_order(kernel->name, {{p, kinds[i] == 2}})) return LAUNCH_FAILED;
            // A table of pointers: every buffer it points to (as many as its buffer holds).
            if (kinds[i] < 3) continue;
            for (const void* q : pointer_table(p)) {
                if (!check_order(kernel->name, {{q, kinds[i] == 4}})) return LAUNCH_FAILED;
            }
        }
        char* report = nullptr;
        running_kernel = kernel->name;
        const int status = emu_run_kernel(*kernel, g.data(), b.data(), pointers.data(), &report);
        running_kernel = nullptr;
        if (status == 0) return OK;
        std::fprintf(stderr, "emulated GPU: kernel %s %s:\n%s", kernel->name,
                     status == -3 ? "deadlocked" : "races on shared memory",
                     report ? report : "");
        std::free(report);
        return LAUNCH_FAILED;
    });
}

// A column-major matrix of cuBLAS, one element read or written as f32.
struct Matrix {
    void* data;
    int type;  // cudaDataType: 0 f32, 2 f16, 14 bf16
    long long ld;
};

float bf16_to_f32(std::uint16_t h) { return __uint_as_float((unsigned)h << 16); }
std::uint16_t f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (std::uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (std::uint16_t)(u >> 16);
}
float f16_to_f32(std::uint16_t h) {
    const unsigned sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0) {
        v = std::ldexp((float)man, -24);
    } else if (exp == 31) {
        v = man ? NAN : INFINITY;
    } else {
        v = std::ldexp((float)(man | 0x400), (int)exp - 25);
    }
    return sign ? -v : v;
}

std::uint16_t f32_to_f16(float f) {
    const unsigned u = __float_as_uint(f), sign = (u >> 16) & 0x8000u;
    const float a = std::fabs(f);
    if (std::isnan(f)) return (std::uint16_t)(sign | 0x7e00u);
    if (a >= 65520.0f) return (std::uint16_t)(sign | 0x7c00u);  // rounds to infinity
    if (a < std::ldexp(1.0f, -14)) {
        // Subnormal: a multiple of 2^-24, rounded to nearest even.
        return (std::uint16_t)(sign | (unsigned)std::nearbyint(a * 16777216.0f));
    }
    int e;
    const float m = std::frexp(a, &e);  // a = m · 2^e, m in [0.5, 1)
    unsigned man = (unsigned)std::nearbyint(std::ldexp(m, 11));  // 11 significant bits
    int exp = e + 14;
    if (man == 2048) {
        man = 1024;
        ++exp;
    }
    if (exp >= 31) return (std::uint16_t)(sign | 0x7c00u);
    return (std::uint16_t)(sign | ((unsigned)exp << 10) | (man - 1024));
}

float load(const Matrix& m, long long i) {
    switch (m.type) {
        case 0: return static_cast<const float*>(m.data)[i];
        case 14: return bf16_to_f32(static_cast<const std::uint16_t*>(m.data)[i]);
        default: return f16_to_f32(static_cast<const std::uint16_t*>(m.data)[i]);
    }
}
void store(const Matrix& m, long long i, float v) {
    if (m.type == 0) {
        static_cast<float*>(m.data)[i] = v;
    } else {
        static_cast<std::uint16_t*>(m.data)[i] = f32_to_bf16(v);
    }
}

// Queues `op` on `stream`: a copy or fill named `what` that touches `uses`, checked against
// other streams' uses of those buffers first.
template <class Op>
CUresult ordered_on(void* stream, const char* what, std::vector<Access> uses, Op op) {
    return run_or_capture(stream, [what, uses = std::move(uses), op] {
        if (!check_order(what, uses)) return LAUNCH_FAILED;
        op();
        return OK;
    });
}

}  // namespace emu

using namespace emu;

// The library's interface; everything else stays inside it (built with -fvisibility=hidden).
#pragma GCC visibility push(default)
extern "C" {

// ---- The driver API ----

CUresult cuInit(unsigned) {
    install_fault_handler();
    return OK;
}
CUresult cuDriverGetVersion(int* version) {
    *version = 13000;
    return OK;
}
CUresult cuDeviceGetCount(int* count) {
    *count = 1;
    return OK;
}
CUresult cuDeviceGet(int* device, int ordinal) {
    if (ordinal != 0) return INVALID_DEVICE;
    *device = 0;
    return OK;
}
CUresult cuDeviceGetName(char* name, int len, int) {
    std::snprintf(name, (std::size_t)len, "megatron-rs emulated GPU (sm_90, on the CPU)");
    return OK;
}
CUresult cuDeviceTotalMem_v2(std::size_t* bytes, int) {
    *bytes = TOTAL_MEMORY;
    return OK;
}
CUresult cuMemGetInfo_v2(std::size_t* free, std::size_t* total) {
    *total = TOTAL_MEMORY;
    *free = TOTAL_MEMORY - used_bytes;
    return OK;
}
CUresult cuDeviceGetAttribute(int* value, int attribute, int) {
    switch (attribute) {
        case 1: *value = MAX_THREADS; break;                  // threads per block
        case 2: case 3: *value = 1024; break;                 // block x, y
        case 4: *value = 64; break;                           // block z
        case 5: *value = 0x7fffffff; break;                   // grid x
        case 6: case 7: *value = 65535; break;                // grid y, z
        case 8: *value = DEFAULT_SHARED; break;               // shared per block
        case 10: *value = 32; break;                          // warp size
        case 16: *value = SMS; break;                         // multiprocessors
        case 39: *value = 2048; break;                        // threads per multiprocessor
        case 75: *value = 9; break;                           // compute capability
        case 76: *value = 0; break;
        case 81: *value = 228 * 1024; break;                  // shared per multiprocessor
        case 97: *value = MAX_SHARED_OPTIN; break;            // shared per block, opt-in
        case 115: *value = 1; break;                          // memory pools
        default: *value = 0;
    }
    return OK;
}

static int primary_context;
thread_local void* current_context = nullptr;
CUresult cuDevicePrimaryCtxRetain(void** ctx, int) {
    *ctx = &primary_context;
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int) { return OK; }
CUresult cuCtxSetCurrent(void* ctx) {
    current_context = ctx;
    return OK;
}
CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = current_context;
    return OK;
}
CUresult cuCtxSynchronize() { return OK; }
CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    *least = 0;
    *greatest = -5;
    return OK;
}

CUresult cuDeviceGetDefaultMemPool(void** pool, int) {
    static int the_pool;
    *pool = &the_pool;
    return OK;
}
CUresult cuMemPoolSetAttribute(void*, int, void*) { return OK; }
CUresult cuMemPoolGetAttribute(void*, int attribute, void* value) {
    const std::lock_guard<std::mutex> lock(memory_lock);
    auto* out = static_cast<unsigned long long*>(value);
    switch (attribute) {
        case 5: case 7: *out = used_bytes; break;  // reserved / used memory, current
        case 6: case 8: *out = used_high; break;   // their high-water marks
        default: *out = 0;
    }
    return OK;
}
CUresult cuMemPoolTrimTo(void*, std::size_t) { return OK; }

// A new stream with the next id.
Stream* new_stream() {
    auto* s = new Stream;
    const std::lock_guard<std::mutex> lock(memory_lock);
    s->id = ++streams_made;
    return s;
}
CUresult cuStreamCreate(void** stream, unsigned) {
    *stream = new_stream();
    return OK;
}
CUresult cuStreamCreateWithPriority(void** stream, unsigned, int) {
    *stream = new_stream();
    return OK;
}
CUresult cuStreamDestroy_v2(void* stream) {
    delete static_cast<Stream*>(stream);
    return OK;
}
CUresult cuStreamSynchronize(void* stream) {
    auto* s = static_cast<Stream*>(stream);
    if (s && s->capturing) return CAPTURE_UNSUPPORTED;
    wait_pending(s);
    if (s) {
        const std::lock_guard<std::mutex> lock(memory_lock);
        synced.join(s->clock);
    }
    return OK;
}
CUresult cuStreamQuery(void* stream) {
    auto* s = static_cast<Stream*>(stream);
    if (s) {
        for (const auto& p : s->pending) {
            if (!p->done.load(std::memory_order_acquire)) return 600;  // CUDA_ERROR_NOT_READY
        }
        s->pending.clear();
    }
    return OK;
}
CUresult cuStreamWaitEvent(void* stream, void* event, unsigned) {
    auto* e = static_cast<Event*>(event);
    return run_or_capture(stream, [e] {
        if (Stream* s = executing) {
            const std::lock_guard<std::mutex> lock(memory_lock);
            s->clock.join(e->clock);
        }
        return OK;
    });
}
CUresult cuLaunchHostFunc(void* stream, void (*fn)(void*), void* data) {
    return run_or_capture(stream, [fn, data] {
        fn(data);
        return OK;
    });
}

CUresult cuEventCreate(void** event, unsigned) {
    *event = new Event;
    return OK;
}
CUresult cuEventDestroy_v2(void* event) {
    delete static_cast<Event*>(event);
    return OK;
}
CUresult cuEventRecord(void* event, void* stream) {
    auto* e = static_cast<Event*>(event);
    return run_or_capture(stream, [e] {
        e->ms = now_ms();
        const std::lock_guard<std::mutex> lock(memory_lock);
        e->clock = executing ? executing->clock : Clock{};
        return OK;
    });
}
CUresult cuEventSynchronize(void* event) {
    const std::lock_guard<std::mutex> lock(memory_lock);
    synced.join(static_cast<Event*>(event)->clock);
    return OK;
}
CUresult cuEventQuery(void*) { return OK; }
CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
    *ms = (float)(static_cast<Event*>(end)->ms - static_cast<Event*>(start)->ms);
    return OK;
}
CUresult cuEventElapsedTime_v2(float* ms, void* start, void* end) {
    return cuEventElapsedTime(ms, start, end);
}

CUresult cuMemAlloc_v2(unsigned long long* ptr, std::size_t bytes) {
    *ptr = allocate(bytes);
    return *ptr ? OK : OUT_OF_MEMORY;
}
// Allocations are made at once, also while a stream is captured: the graph then keeps using
// that memory (a captured free does nothing, the buffer outlives the graph).
CUresult cuMemAllocAsync(unsigned long long* ptr, std::size_t bytes, void*) {
    return cuMemAlloc_v2(ptr, bytes);
}
CUresult cuMemFree_v2(unsigned long long ptr) { return release(ptr); }
CUresult cuMemFreeAsync(unsigned long long ptr, void* stream) {
    auto* s = static_cast<Stream*>(stream);
    if (s && s->capturing) return OK;
    return run_or_capture(stream, [ptr] {
        if (!check_order("cuMemFreeAsync", {{reinterpret_cast<void*>(ptr), true}})) {
            return LAUNCH_FAILED;
        }
        return release(ptr);
    });
}
CUresult cuMemsetD8Async(unsigned long long ptr, unsigned char value, std::size_t n,
                         void* stream) {
    auto* p = reinterpret_cast<void*>(ptr);
    return ordered_on(stream, "cuMemsetD8Async", {{p, true}}, [=] { std::memset(p, value, n); });
}
CUresult cuMemsetD8_v2(unsigned long long ptr, unsigned char value, std::size_t n) {
    return cuMemsetD8Async(ptr, value, n, nullptr);
}
CUresult cuMemsetD32Async(unsigned long long ptr, unsigned value, std::size_t n, void* stream) {
    auto* p = reinterpret_cast<unsigned*>(ptr);
    return ordered_on(stream, "cuMemsetD32Async", {{p, true}}, [=] { std::fill(p, p + n, value); });
}
// Whether `stream` is being captured: a copy between the host and the device may not be, as
// the graph would read (or write) host memory at replay that the program may have freed, and a
// read-back would need a synchronisation inside the capture.
bool host_copy_in_capture(void* stream, const char* what) {
    auto* s = static_cast<Stream*>(stream);
    if (!s || !s->capturing) return false;
    std::fprintf(stderr, "emulated GPU: %s while the stream is captured\n", what);
    return true;
}

CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, std::size_t n,
                              void* stream) {
    if (host_copy_in_capture(stream, "cuMemcpyHtoDAsync")) return CAPTURE_UNSUPPORTED;
    bytes_to_device += n;
    auto* d = reinterpret_cast<void*>(dst);
    return ordered_on(stream, "cuMemcpyHtoDAsync", {{d, true}}, [=] { std::memcpy(d, src, n); });
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, std::size_t n, void* stream) {
    if (host_copy_in_capture(stream, "cuMemcpyDtoHAsync")) return CAPTURE_UNSUPPORTED;
    bytes_to_host += n;
    auto* s = reinterpret_cast<const void*>(src);
    return ordered_on(stream, "cuMemcpyDtoHAsync", {{s, false}}, [=] { std::memcpy(dst, s, n); });
}
CUresult cuMemcpyDtoDAsync_v2(unsigned long long dst, unsigned long long src, std::size_t n,
                              void* stream) {
    auto* d = reinterpret_cast<void*>(dst);
    auto* s = reinterpret_cast<const void*>(src);
    return ordered_on(stream, "cuMemcpyDtoDAsync", {{s, false, n}, {d, true, n}},
                      [=] { std::memmove(d, s, n); });
}
CUresult cuMemcpyHtoD_v2(unsigned long long dst, const void* src, std::size_t n) {
    return cuMemcpyHtoDAsync_v2(dst, src, n, nullptr);
}
CUresult cuMemcpyDtoH_v2(void* dst, unsigned long long src, std::size_t n) {
    return cuMemcpyDtoHAsync_v2(dst, src, n, nullptr);
}
CUresult cuMemcpyDtoD_v2(unsigned long long dst, unsigned long long src, std::size_t n) {
    return cuMemcpyDtoDAsync_v2(dst, src, n, nullptr);
}
CUresult cuMemcpyAsync(unsigned long long dst, unsigned long long src, std::size_t n,
                       void* stream) {
    return cuMemcpyDtoDAsync_v2(dst, src, n, stream);
}

// The line before the CUDA C a generated program's PTX carries (cuda/programs.rs, SOURCE_MARK),
// each of its lines after `//| `.
constexpr const char* SOURCE_MARK = "// megatron-rs generated source\n";

// Compiles the CUDA C that the PTX of a generated program carries (#[megatron::module]'s fused
// kernels) for the CPU, as launch.cpp is, loads it and adds its kernels `names`; false, with
// the reason on stderr, when the PTX carries none or it does not build. Built once per source
// text, under the system's temporary folder.
bool load_generated(const std::string& ptx, const std::vector<std::string>& names) {
    const std::size_t mark = ptx.find(SOURCE_MARK);
    if (mark == std::string::npos) return false;
    std::string source;
    for (std::size_t at = mark + std::strlen(SOURCE_MARK); at < ptx.size();) {
        std::size_t end = ptx.find('\n', at);
        if (end == std::string::npos) end = ptx.size();
        const std::string line = ptx.substr(at, end - at);
        if (line.rfind("//| ", 0) == 0) source += line.substr(4);
        source += '\n';
        at = end + 1;
    }
    std::string text = "#include \"shim.h\"\n#include \"common.cuh\"\n#include \"emu_kernel.h\"\n" +
                       source + "\nstatic const EmuKernel emu_generated_table[] = {\n";
    for (const auto& n : names) text += "    EMU_KERNEL(" + n + "),\n";
    text += "};\nextern \"C\" __attribute__((visibility(\"default\"))) const EmuKernel* "
            "emu_generated_kernels(int* count) {\n    *count = " +
            std::to_string(names.size()) + ";\n    return emu_generated_table;\n}\n";
    const std::string dir = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") +
                            "/megatron-emulated-generated";
    const std::string stem =
        dir + "/" + std::to_string(std::hash<std::string>{}(text + EMU_BUILD_FLAGS));
    const std::string lib = stem + ".so";
    if (access(lib.c_str(), R_OK) != 0) {
        const std::string tmp = stem + "." + std::to_string(getpid()) + "." +
                                std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
        std::system(("mkdir -p '" + dir + "'").c_str());
        FILE* f = std::fopen((tmp + ".cpp").c_str(), "w");
        if (!f) return false;
        std::fwrite(text.data(), 1, text.size(), f);
        std::fclose(f);
        const std::string cmd = std::string(EMU_CXX) + " " + EMU_BUILD_FLAGS + " -fvisibility=hidden -o '" +
                                tmp + ".so' '" + tmp + ".cpp' 2>&1";
        if (std::system(cmd.c_str()) != 0) {
            std::fprintf(stderr, "emulated GPU: compiling a generated program failed: %s\n",
                         cmd.c_str());
            return false;
        }
        std::rename((tmp + ".so").c_str(), lib.c_str());
        std::remove((tmp + ".cpp").c_str());
    }
    void* handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        std::fprintf(stderr, "emulated GPU: loading %s failed: %s\n", lib.c_str(), dlerror());
        return false;
    }
    using Table = const EmuKernel* (*)(int*);
    auto table = reinterpret_cast<Table>(dlsym(handle, "emu_generated_kernels"));
    if (!table) return false;
    int count = 0;
    const EmuKernel* kernels = table(&count);
    emu_add_kernels(kernels, count);
    return true;
}

// PTX from NVRTC: its entries name the kernels (which must all be emulated; those of a
// generated program are compiled from the source it carries).
CUresult cuModuleLoadData(void** module, const void* image) {
    const std::string ptx(static_cast<const char*>(image));
    // The driver's PTX parser takes ASCII only, comments included: an H200 (2026-11-30)
    // refused a generated kernel's PTX whose carried source held UTF-8 in comments.
    for (const unsigned char c : ptx) {
        if (c > 0x7f) {
            std::fprintf(stderr, "emulated GPU: PTX with a byte outside ASCII (0x%02x)\n", c);
            return INVALID_PTX;
        }
    }
    auto* m = new Module;
    m->max_threads = entries(ptx);
    std::vector<std::string> unknown;
    for (const auto& [name, threads] : m->max_threads) {
        if (!emu_find_kernel(name.c_str())) unknown.push_back(name);
    }
    if (!unknown.empty()) load_generated(ptx, unknown);
    for (const auto& [name, threads] : m->max_threads) {
        if (!emu_find_kernel(name.c_str())) {
            std::fprintf(stderr,
                         "emulated GPU: the PTX has a kernel %s that launch.cpp does not "
                         "emulate (add it to EMU_KERNELS)\n",
                         name.c_str());
            delete m;
            return INVALID_IMAGE;
        }
    }
    *module = m;
    return OK;
}
CUresult cuModuleUnload(void* module) {
    delete static_cast<Module*>(module);
    return OK;
}
CUresult cuModuleGetFunction(void** function, void* module, const char* name) {
    auto* m = static_cast<Module*>(module);
    const auto known = m->max_threads.find(name);
    const EmuKernel* kernel = emu_find_kernel(name);
    if (known == m->max_threads.end() || !kernel) return NOT_FOUND;
    auto [it, _] = m->functions.try_emplace(name, Function{kernel, known->second});
    *function = &it->second;
    return OK;
}
CUresult cuFuncSetAttribute(void* function, int attribute, int value) {
    auto* f = static_cast<Function*>(function);
    if (attribute == 8) {  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if (value < 0 || value > MAX_SHARED_OPTIN) return INVALID_VALUE;
        f->max_dynamic_shared = value;
    }
    return OK;
}
CUresult cuFuncGetAttribute(int* value, int attribute, void* function) {
    auto* f = static_cast<Function*>(function);
    switch (attribute) {
        case 0: *value = f->max_threads ? (int)f->max_threads : MAX_THREADS; break;
        case 8: *value = f->max_dynamic_shared; break;
        default: *value = 0;
    }
    return OK;
}
CUresult cuLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, void* stream, void** params,
                        void** extra) {
    if (extra) return NOT_SUPPORTED;
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    return launch(static_cast<Function*>(function), grid, block, shared, stream, params);
}

CUresult cuStreamBeginCapture_v2(void* stream, int) {
    auto* s = static_cast<Stream*>(stream);
    if (!s || s->capturing) return INVALID_VALUE;
    s->capturing = true;
    s->captured.clear();
    return OK;
}
CUresult cuStreamEndCapture(void* stream, void** graph) {
    auto* s = static_cast<Stream*>(stream);
    if (!s || !s->capturing) return INVALID_VALUE;
    s->capturing = false;
    *graph = new Graph{std::move(s->captured)};
    s->captured.clear();
    return OK;
}
CUresult cuStreamIsCapturing(void* stream, int* status) {
    auto* s = static_cast<Stream*>(stream);
    *status = s && s->capturing ? 1 : 0;
    return OK;
}
CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    *exec = new Graph(*static_cast<Graph*>(graph));
    return OK;
}
// The counters of what the calling thread asked (see host_ops): out[0] operations it queued,
// out[1] kernels run, out[2] graph launches, out[3] and out[4] the bytes its copies moved to
// the device and to the host, out[5] the tiles the flash-attention kernels walked.
void megatron_emu_launches(unsigned long long* out) {
    out[0] = host_ops;
    out[1] = kernels_run;
    out[2] = graph_launches;
    out[3] = bytes_to_device;
    out[4] = bytes_to_host;
    out[5] = emu_tiles_walked;
}
CUresult cuGraphLaunch(void* exec, void* stream) {
    auto* g = static_cast<Graph*>(exec);
    ++graph_launches;
    return run_or_capture(stream, [g] {
        for (Work& w : g->work) {
            if (const CUresult r = w(); r != OK) return r;
        }
        return OK;
    });
}
CUresult cuGraphUpload(void*, void*) { return OK; }
CUresult cuGraphDestroy(void* graph) {
    delete static_cast<Graph*>(graph);
    return OK;
}
CUresult cuGraphExecDestroy(void* exec) {
    delete static_cast<Graph*>(exec);
    return OK;
}

CUresult cuGetErrorName(CUresult, const char** name) {
    *name = "CUDA_ERROR (emulated)";
    return OK;
}
CUresult cuGetErrorString(CUresult, const char** text) {
    *text = "see the emulated GPU's message on stderr";
    return OK;
}

// ---- cuBLAS ----

struct BlasHandle {
    void* stream = nullptr;
};

int cublasCreate_v2(void** handle) {
    *handle = new BlasHandle;
    return 0;
}
int cublasDestroy_v2(void* handle) {
    delete static_cast<BlasHandle*>(handle);
    return 0;
}
int cublasSetStream_v2(void* handle, void* stream) {
    static_cast<BlasHandle*>(handle)->stream = stream;
    return 0;
}
int cublasSetWorkspace_v2(void*, void*, std::size_t) { return 0; }
int cublasSetMathMode(void*, int) { return 0; }

// One product D = alpha·op(A)·op(B) + beta·C (+ bias[row]), column-major, accumulated in f32
// (in its own order: cuBLAS's differs, within rounding). D may be C. beta = 0 does not read C
// (it may hold NaN), as cuBLAS.
struct Gemm {
    bool transa, transb;
    int m, n, k;
    float alpha, beta;
    Matrix a, b, c, d;
    const void* bias;  // null, or `m` elements of `bias_type` added to each column
    int bias_type;
};

static void gemm(const Gemm& g) {
    const int m = g.m, n = g.n, k = g.k;
    // op(A) as rows of k (m of them) and op(B) as columns of k (n), in f32.
    std::vector<float> rows((std::size_t)m * k), columns((std::size_t)n * k);
    for (int i = 0; i < m; ++i) {
        for (int l = 0; l < k; ++l) {
            rows[(std::size_t)i * k + l] =
                load(g.a, g.transa ? l + (long long)i * g.a.ld : i + (long long)l * g.a.ld);
        }
    }
    for (int j = 0; j < n; ++j) {
        for (int l = 0; l < k; ++l) {
            columns[(std::size_t)j * k + l] =
                load(g.b, g.transb ? j + (long long)l * g.b.ld : l + (long long)j * g.b.ld);
        }
    }
    const Matrix bias{const_cast<void*>(g.bias), g.bias_type, 0};
    for (int j = 0; j < n; ++j) {
        const float* column = &columns[(std::size_t)j * k];
        for (int i = 0; i < m; ++i) {
            const float* row = &rows[(std::size_t)i * k];
            // Eight partial sums (as a GEMM's vector lanes would), then their sum.
            float part[8] = {};
            int l = 0;
            for (; l + 8 <= k; l += 8) {
                for (int v = 0; v < 8; ++v) part[v] += row[l + v] * column[l + v];
            }
            for (; l < k; ++l) part[l % 8] += row[l] * column[l];
            float sum = 0.0f;
            for (float p : part) sum += p;
            const float old = g.beta == 0.0f ? 0.0f : g.beta * load(g.c, i + (long long)j * g.c.ld);
            float v = g.alpha * sum + old;
            if (g.bias) v += load(bias, i);
            store(g.d, i + (long long)j * g.d.ld, v);
        }
    }
}

static int gemm_element_size(int type) { return type == 0 ? 4 : 2; }

// C = alpha·op(A)·op(B) + beta·C for each of `batch` matrices.
int cublasGemmStridedBatchedEx(void* handle, int transa, int transb, int m, int n, int k,
                               const void* alpha, const void* a, int atype, int lda,
                               long long stride_a, const void* b, int btype, int ldb,
                               long long stride_b, const void* beta, void* c, int ctype, int ldc,
                               long long stride_c, int batch, int compute, int) {
    const bool known_types = (atype == 0 || atype == 2 || atype == 14) && atype == btype &&
                             (ctype == 0 || ctype == atype);
    const bool f32_compute = compute == 68 || compute == 75 || compute == 77 || compute == 0;
    if (!known_types || !f32_compute || m < 0 || n < 0 || k < 0 || batch < 0) return 15;
    if (lda < std::max(1, transa ? k : m) || ldb < std::max(1, transb ? n : k) ||
        ldc < std::max(1, m)) {
        return 7;  // CUBLAS_STATUS_INVALID_VALUE
    }
    const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
    auto* h = static_cast<BlasHandle*>(handle);
    const int esize_a = gemm_element_size(atype), esize_c = gemm_element_size(ctype);
    const CUresult r = run_or_capture(h->stream, [=] {
        if (!check_order("cublasGemmStridedBatchedEx", {{a, false}, {b, false}, {c, true}})) {
            return LAUNCH_FAILED;
        }
        for (int p = 0; p < batch; ++p) {
            const Matrix C{(char*)c + stride_c * p * esize_c, ctype, ldc};
            gemm(Gemm{transa != 0, transb != 0, m, n, k, al, be,
                      Matrix{(char*)a + stride_a * p * esize_a, atype, lda},
                      Matrix{(char*)b + stride_b * p * esize_a, btype, ldb}, C, C, nullptr, 0});
        }
        return OK;
    });
    return r == OK ? 0 : 13;  // CUBLAS_STATUS_EXECUTION_FAILED
}
int cublasGemmEx(void* handle, int transa, int transb, int m, int n, int k, const void* alpha,
                 const void* a, int atype, int lda, const void* b, int btype, int ldb,
                 const void* beta, void* c, int ctype, int ldc, int compute, int algo) {
    return cublasGemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, a, atype, lda, 0, b,
                                      btype, ldb, 0, beta, c, ctype, ldc, 0, 1, compute, algo);
}

// ---- cuBLASLt: single (unbatched) products with the default or the bias epilogue ----

struct LtLayout {
    int type;
    unsigned long long rows, cols;
    long long ld;
    int batch = 1;
};
struct LtDesc {
    int compute, scale;
    int transa = 0, transb = 0;
    int epilogue = 1;  // CUBLASLT_EPILOGUE_DEFAULT
    const void* bias = nullptr;
    int bias_type = -1;  // -1: D's type
};
// cublasLtMatmulHeuristicResult_t: the algorithm's 64 bytes, workspace size, state, waves.
struct LtHeuristic {
    unsigned long long algo[8];
    std::size_t workspace;
    int state;
    float waves;
    int reserved[4];
};

// Attribute numbers of cublasLt.h (CUDA 13).
constexpr int LT_TRANSA = 3, LT_TRANSB = 4, LT_EPILOGUE = 7, LT_BIAS_POINTER = 8,
              LT_BIAS_DATA_TYPE = 26, LT_LAYOUT_BATCH_COUNT = 1;
constexpr int LT_EPILOGUE_DEFAULT = 1, LT_EPILOGUE_BIAS = 4;

// Copies an attribute's value into `out` if it has `out`'s size.
static bool read_attribute(const void* buf, std::size_t size, void* out, std::size_t want) {
    if (size != want) return false;
    std::memcpy(out, buf, want);
    return true;
}
#define READ_ATTRIBUTE(field) read_attribute(buf, size, &(field), sizeof(field))

int cublasLtCreate(void** handle) {
    *handle = new BlasHandle;
    return 0;
}
int cublasLtDestroy(void* handle) {
    delete static_cast<BlasHandle*>(handle);
    return 0;
}
int cublasLtMatmulDescCreate(void** desc, int compute, int scale) {
    *desc = new LtDesc{compute, scale};
    return 0;
}
int cublasLtMatmulDescDestroy(void* desc) {
    delete static_cast<LtDesc*>(desc);
    return 0;
}
int cublasLtMatmulDescSetAttribute(void* desc, int attr, const void* buf, std::size_t size) {
    auto* d = static_cast<LtDesc*>(desc);
    bool ok = false;
    switch (attr) {
        case LT_TRANSA: ok = READ_ATTRIBUTE(d->transa); break;
        case LT_TRANSB: ok = READ_ATTRIBUTE(d->transb); break;
        case LT_EPILOGUE: ok = READ_ATTRIBUTE(d->epilogue); break;
        case LT_BIAS_POINTER: ok = READ_ATTRIBUTE(d->bias); break;
        case LT_BIAS_DATA_TYPE: ok = READ_ATTRIBUTE(d->bias_type); break;
        default:
            std::fprintf(stderr, "emulated cuBLASLt: matmul attribute %d is not modelled\n", attr);
            return 15;  // CUBLAS_STATUS_NOT_SUPPORTED
    }
    return ok ? 0 : 7;
}
int cublasLtMatrixLayoutCreate(void** layout, int type, unsigned long long rows,
                               unsigned long long cols, long long ld) {
    *layout = new LtLayout{type, rows, cols, ld};
    return 0;
}
int cublasLtMatrixLayoutDestroy(void* layout) {
    delete static_cast<LtLayout*>(layout);
    return 0;
}
int cublasLtMatrixLayoutSetAttribute(void* layout, int attr, const void* buf, std::size_t size) {
    if (attr != LT_LAYOUT_BATCH_COUNT) return 15;
    return READ_ATTRIBUTE(static_cast<LtLayout*>(layout)->batch) ? 0 : 7;
}
// The preference's minimum alignments of A, B, C and D: cuBLASLt assumes 256 bytes unless told
// less, and its algorithm may then need them.
struct LtPreference {
    unsigned align[4] = {256, 256, 256, 256};
};
constexpr int LT_PREF_MIN_ALIGNMENT_A = 5;  // B, C, D follow

int cublasLtMatmulPreferenceCreate(void** pref) {
    *pref = new LtPreference;
    return 0;
}
int cublasLtMatmulPreferenceDestroy(void* pref) {
    delete static_cast<LtPreference*>(pref);
    return 0;
}
int cublasLtMatmulPreferenceSetAttribute(void* pref, int attr, const void* buf,
                                         std::size_t size) {
    const int which = attr - LT_PREF_MIN_ALIGNMENT_A;
    if (which < 0 || which > 3) return 0;  // the workspace limit: nothing to model
    return READ_ATTRIBUTE(static_cast<LtPreference*>(pref)->align[which]) ? 0 : 7;
}

// The product a descriptor and four layouts describe, or why it is not one the emulation (and,
// as far as it models it, cuBLASLt) runs: returns null with `why` set.
static const char* lt_check(const LtDesc& d, const LtLayout& a, const LtLayout& b,
                            const LtLayout& c, const LtLayout& dl) {
    if (d.compute != 68 || d.scale != 0) return "compute or scale type other than f32";
    if (a.type != b.type || (a.type != 0 && a.type != 14)) return "A and B not both f32 or bf16";
    if (c.type != dl.type || (dl.type != 0 && dl.type != a.type)) return "C/D type";
    if (d.epilogue != LT_EPILOGUE_DEFAULT && d.epilogue != LT_EPILOGUE_BIAS) return "epilogue";
    if (d.epilogue == LT_EPILOGUE_BIAS) {
        // The bias in D's type: an f32 bias with a bf16 D had no algorithm on an H100
        // (2026-11-27) nor on an H200 (2026-11-30), for any shape tried.
        const int bt = d.bias_type < 0 ? dl.type : d.bias_type;
        if (bt != dl.type) return "bias type other than D's";
    }
    if (a.batch != 1 || b.batch != 1 || c.batch != 1 || dl.batch != 1) return "batched layouts";
    const unsigned long long m = d.transa ? a.cols : a.rows, k = d.transa ? a.rows : a.cols;
    const unsigned long long kb = d.transb ? b.cols : b.rows, n = d.transb ? b.rows : b.cols;
    if (k != kb || c.rows != m || c.cols != n || dl.rows != m || dl.cols != n) return "shapes";
    if (a.ld < (long long)std::max(1ull, a.rows) || b.ld < (long long)std::max(1ull, b.rows) ||
        c.ld < (long long)std::max(1ull, m) || dl.ld < (long long)std::max(1ull, m)) {
        return "leading dimensions";
    }
    return nullptr;
}

int cublasLtMatmulAlgoGetHeuristic(void*, void* desc, void* a, void* b, void* c, void* d,
                                   void* pref, int requested, void* results, int* returned) {
    *returned = 0;
    if (requested < 1) return 7;
    if (lt_check(*static_cast<LtDesc*>(desc), *static_cast<LtLayout*>(a),
                 *static_cast<LtLayout*>(b), *static_cast<LtLayout*>(c),
                 *static_cast<LtLayout*>(d))) {
        return 15;  // no algorithm: CUBLAS_STATUS_NOT_SUPPORTED
    }
    LtHeuristic h{};
    h.algo[0] = 0x1e;  // an algorithm the emulated cublasLtMatmul recognises
    // The alignments it was chosen for, which cublasLtMatmul's pointers must then have.
    for (int i = 0; i < 4; ++i) h.algo[1 + i] = static_cast<LtPreference*>(pref)->align[i];
    h.waves = 1.0f;
    std::memcpy(results, &h, sizeof h);
    *returned = 1;
    return 0;
}

int cublasLtMatmul(void*, void* desc, const void* alpha, const void* a, void* adesc,
                   const void* b, void* bdesc, const void* beta, const void* c, void* cdesc,
                   void* d, void* ddesc, const void* algo, void*, std::size_t, void* stream) {
    const LtDesc& ds = *static_cast<LtDesc*>(desc);
    const LtLayout &al = *static_cast<LtLayout*>(adesc), &bl = *static_cast<LtLayout*>(bdesc),
                   &cl = *static_cast<LtLayout*>(cdesc), &dl = *static_cast<LtLayout*>(ddesc);
    if (const char* why = lt_check(ds, al, bl, cl, dl)) {
        std::fprintf(stderr, "emulated cublasLtMatmul: unsupported product (%s)\n", why);
        return 15;
    }
    if (!algo || static_cast<const unsigned long long*>(algo)[0] != 0x1e) {
        std::fprintf(stderr, "emulated cublasLtMatmul: the algorithm is not the heuristic's\n");
        return 7;
    }
    const auto* chosen = static_cast<const unsigned long long*>(algo);
    const void* pointers[4] = {a, b, c, d};
    for (int i = 0; i < 4; ++i) {
        if (reinterpret_cast<std::uintptr_t>(pointers[i]) % chosen[1 + i] != 0) {
            std::fprintf(stderr,
                         "emulated cublasLtMatmul: %c at %p is not aligned to the %llu bytes "
                         "the algorithm was chosen for\n",
                         "ABCD"[i], pointers[i], chosen[1 + i]);
            return 7;
        }
    }
    const bool with_bias = ds.epilogue == LT_EPILOGUE_BIAS;
    if (with_bias && !ds.bias) {
        std::fprintf(stderr, "emulated cublasLtMatmul: the bias epilogue has no bias pointer\n");
        return 7;
    }
    const Gemm g{ds.transa != 0, ds.transb != 0, (int)dl.rows, (int)dl.cols,
                 (int)(ds.transa ? al.rows : al.cols), *static_cast<const float*>(alpha),
                 *static_cast<const float*>(beta), Matrix{const_cast<void*>(a), al.type, al.ld},
                 Matrix{const_cast<void*>(b), bl.type, bl.ld},
                 Matrix{const_cast<void*>(c), cl.type, cl.ld}, Matrix{d, dl.type, dl.ld},
                 with_bias ? ds.bias : nullptr,
                 ds.bias_type < 0 ? dl.type : ds.bias_type};
    const CUresult r = run_or_capture(stream, [g] {
        std::vector<Access> uses{{g.a.data, false}, {g.b.data, false}, {g.d.data, true}};
        if (g.beta != 0.0f) uses.push_back({g.c.data, false});
        if (g.bias) uses.push_back({g.bias, false});
        if (!check_order("cublasLtMatmul", uses)) return LAUNCH_FAILED;
        gemm(g);
        return OK;
    });
    return r == OK ? 0 : 13;
}

}  // extern "C"
#pragma GCC visibility pop

#include "nccl.cpp"
