// A size-keyed cache in front of torch's CPU allocator, for the large blocks of a training step.
//
// Backward allocates the same few block sizes once per layer (weight gradients, their fp32 copies, the
// activation gradients) and frees each one before the next layer asks for the same size again. glibc
// either keeps such blocks in its heap (its mmap threshold rises to 32 MiB after the first large free,
// and the freed memory stays resident, fragmented, for the life of the process) or, with a fixed
// threshold, unmaps every one on free, so that the next layer faults the same pages in again, one 4 KiB
// page at a time. This allocator maps blocks of at least `min_bytes` itself and, on free, keeps them
// for reuse while the freed bytes it holds stay within a limit: `fraction` of the bytes in use, but at
// least `floor_bytes` (and at most `ceiling_bytes` when that is set); beyond it the least recently freed
// blocks are unmapped. Freed-but-resident memory is therefore at most that fraction of what the process
// uses through this allocator, which scales the cache with the model (one layer's gradients are a fixed
// share of it) and shrinks it when a step's transients are gone. A block size that comes back within a
// step is served without a page fault. Blocks of `huge_bytes` or more are aligned to 2 MiB and
// advised MADV_HUGEPAGE, so that a first touch faults 2 MiB at a time where the kernel's THP mode is
// `madvise`. Smaller requests go to the allocator that was installed before.
//
// Tensors allocated before `install` keep their own deleters; blocks handed out before `uninstall` come
// back here when freed (the instance is never destroyed, so a tensor freed at interpreter exit is safe).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>

namespace py = pybind11;

namespace fp4host {

constexpr size_t kHuge = size_t(2) << 20;  // x86-64 transparent huge page

struct Block {
  void* map;         // what mmap returned (may start before `data` when aligned to 2 MiB)
  size_t map_bytes;  // length of the mapping
  void* data;        // what the tensor sees
  size_t bytes;      // usable length from `data`
};

class CachingHostAllocator final : public c10::Allocator {
 public:
  static CachingHostAllocator& get() {
    static auto* instance = new CachingHostAllocator();  // never destroyed: see the header comment
    return *instance;
  }

  c10::DataPtr allocate(size_t n) override {
    c10::Allocator* prev = prev_.load();
    if (n < min_bytes_.load() || prev == nullptr) {
      TORCH_CHECK(prev != nullptr, "fp4offload host allocator: allocate() before install()");
      return prev->allocate(n);
    }
    void* data = take(n);
    return {data, data, &CachingHostAllocator::free_fn, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CachingHostAllocator::free_fn; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool install(size_t min_bytes, double fraction, size_t floor_bytes, size_t ceiling_bytes, size_t huge_bytes,
               uint8_t priority) {
    std::lock_guard<std::mutex> g(mu_);
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current == this) {
      configure_locked(min_bytes, fraction, floor_bytes, ceiling_bytes, huge_bytes);
      return true;
    }
    prev_ = current;
    configure_locked(min_bytes, fraction, floor_bytes, ceiling_bytes, huge_bytes);
    // A fork while another thread holds the lock (a DataLoader worker started during a free) would leave the
    // child's copy locked forever: hold it across fork, as glibc's malloc does with its own.
    static std::once_flag atfork;
    std::call_once(atfork, [] {
      pthread_atfork([] { get().mu_.lock(); }, [] { get().mu_.unlock(); }, [] { get().mu_.unlock(); });
    });
    priority_ = priority;
    c10::SetCPUAllocator(this, priority);
    if (c10::GetCPUAllocator() != this) {  // a higher-priority allocator is registered: leave it
      prev_ = nullptr;
      return false;
    }
    return true;
  }

  bool uninstall() {
    std::lock_guard<std::mutex> g(mu_);
    if (c10::GetCPUAllocator() != this || prev_.load() == nullptr) return false;
    c10::SetCPUAllocator(prev_.load(), priority_);
    // prev_ stays: blocks handed out earlier still come back here, and smaller raw blocks go to it
    release_locked(0);
    return true;
  }

  bool installed() const { return c10::GetCPUAllocator() == this; }

  size_t empty_cache() {
    std::lock_guard<std::mutex> g(mu_);
    size_t before = cached_;
    release_locked(0);
    return before;
  }

  struct Stats {
    bool installed;
    double fraction;
    uint64_t min_bytes, floor_bytes, ceiling_bytes, limit_bytes, huge_bytes, allocs, hits, maps, unmaps,
        mapped_bytes, in_use_bytes, cached_bytes, cached_blocks, peak_cached_bytes, peak_in_use_bytes, bytes_reused;
  };

  // Counters, copied under the lock and handed to Python after it is released: building Python objects can
  // run the garbage collector, which can free a tensor, whose deleter takes the lock again.
  Stats stats() {
    std::lock_guard<std::mutex> g(mu_);
    return {c10::GetCPUAllocator() == this, fraction_, min_bytes_.load(), floor_, ceiling_, limit_locked(), huge_,
            allocs_, hits_, maps_, unmaps_, mapped_, in_use_, cached_, free_by_size_.size(), peak_cached_,
            peak_in_use_, bytes_reused_};
  }


 private:
  CachingHostAllocator() = default;

  void configure_locked(size_t min_bytes, double fraction, size_t floor_bytes, size_t ceiling_bytes,
                        size_t huge_bytes) {
    TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "fp4offload host allocator: fraction ", fraction,
                " is outside [0, 1]");
    min_bytes_.store(min_bytes < 1 ? 1 : min_bytes);
    fraction_ = fraction;
    floor_ = floor_bytes;
    ceiling_ = ceiling_bytes;
    huge_ = huge_bytes;
    release_locked(limit_locked());
  }

  // How many freed bytes may stay cached now.
  size_t limit_locked() const {
    size_t lim = static_cast<size_t>(fraction_ * static_cast<double>(in_use_));
    if (lim < floor_) lim = floor_;
    if (ceiling_ != 0 && lim > ceiling_) lim = ceiling_;
    return lim;
  }

  static size_t page() {
    static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return p;
  }

  static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

  // A cached block of at least `bytes` and at most 1/8 larger, or nullptr.
  Block* find_locked(size_t bytes) {
    auto it = free_by_size_.lower_bound(bytes);
    if (it == free_by_size_.end() || it->first > bytes + bytes / 8) return nullptr;
    auto lru = it->second;
    free_by_size_.erase(it);
    Block* b = *lru;
    lru_.erase(lru);
    cached_ -= b->bytes;
    return b;
  }

  Block* map_block(size_t bytes) {
    const bool huge = huge_ != 0 && bytes >= huge_;
    const size_t map_bytes = huge ? bytes + kHuge : bytes;
    void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    void* data = m;
    if (huge) {
      auto a = reinterpret_cast<uintptr_t>(m);
      data = reinterpret_cast<void*>(round_up(a, kHuge));
      madvise(data, bytes, MADV_HUGEPAGE);  // advisory: ignored where THP is off
    }
    return new Block{m, map_bytes, data, bytes};
  }

  void unmap_locked(Block* b) {
    munmap(b->map, b->map_bytes);
    mapped_ -= b->map_bytes;
    ++unmaps_;
    delete b;
  }

  void* take(size_t n) {
    const size_t bytes = round_up(n, page());
    std::lock_guard<std::mutex> g(mu_);
    ++allocs_;
    Block* b = find_locked(bytes);
    if (b != nullptr) {
      ++hits_;
      bytes_reused_ += b->bytes;
    } else {
      b = map_block(bytes);
      if (b == nullptr) {  // out of address space or memory: give the cache back and try once more
        release_locked(0);
        b = map_block(bytes);
      }
      TORCH_CHECK_WITH(OutOfMemoryError, b != nullptr, "fp4offload host allocator: mmap of ", bytes,
                       " bytes failed (out of host memory); ", in_use_, " bytes in use");
      ++maps_;
      mapped_ += b->map_bytes;
    }
    in_use_ += b->bytes;
    if (in_use_ > peak_in_use_) peak_in_use_ = in_use_;
    live_.emplace(b->data, b);
    return b->data;
  }

  static void free_fn(void* data) { get().give_back(data); }

  void give_back(void* data) {
    if (data == nullptr) return;
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(data);
    if (it == live_.end()) {  // a small raw block that the previous allocator served
      c10::Allocator* prev = prev_.load();
      c10::DeleterFnPtr d = prev != nullptr ? prev->raw_deleter() : nullptr;
      if (d != nullptr) d(data);  // (no deleter to call: leak it rather than throw from a destructor)
      return;
    }
    Block* b = it->second;
    live_.erase(it);
    in_use_ -= b->bytes;
    const size_t limit = limit_locked();
    if (b->bytes > limit || c10::GetCPUAllocator() != this) {
      release_locked(limit);
      unmap_locked(b);
      return;
    }
    lru_.push_back(b);
    free_by_size_.emplace(b->bytes, std::prev(lru_.end()));
    cached_ += b->bytes;
    release_locked(limit);
    if (cached_ > peak_cached_) peak_cached_ = cached_;
  }

  // Unmap the least recently freed blocks until at most `keep` bytes stay cached.
  void release_locked(size_t keep) {
    while (cached_ > keep && !lru_.empty()) {
      Block* b = lru_.front();
      auto range = free_by_size_.equal_range(b->bytes);
      for (auto it = range.first; it != range.second; ++it) {
        if (*it->second == b) {
          free_by_size_.erase(it);
          break;
        }
      }
      lru_.pop_front();
      cached_ -= b->bytes;
      unmap_locked(b);
    }
  }

  std::mutex mu_;
  std::atomic<c10::Allocator*> prev_{nullptr};  // read by allocate() without the lock
  uint8_t priority_ = 0;
  std::atomic<size_t> min_bytes_{size_t(1) << 20};
  double fraction_ = 0.0;
  size_t floor_ = 0, ceiling_ = 0;
  size_t huge_ = 0;
  std::list<Block*> lru_;                                         // freed blocks, least recent first
  std::multimap<size_t, std::list<Block*>::iterator> free_by_size_;
  std::unordered_map<void*, Block*> live_;
  size_t mapped_ = 0, in_use_ = 0, cached_ = 0, peak_cached_ = 0, peak_in_use_ = 0;
  uint64_t allocs_ = 0, hits_ = 0, maps_ = 0, unmaps_ = 0, bytes_reused_ = 0;
};

}  // namespace fp4host

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using fp4host::CachingHostAllocator;
  m.def(
      "install",
      [](size_t min_bytes, double fraction, size_t floor_bytes, size_t ceiling_bytes, size_t huge_bytes,
         int priority) {
        return CachingHostAllocator::get().install(min_bytes, fraction, floor_bytes, ceiling_bytes, huge_bytes,
                                                   static_cast<uint8_t>(priority));
      },
      "make the caching allocator torch's CPU allocator (or reconfigure it); False when a higher-priority one "
      "is registered",
      py::arg("min_bytes"), py::arg("fraction"), py::arg("floor_bytes"), py::arg("ceiling_bytes"),
      py::arg("huge_bytes"), py::arg("priority"));
  m.def("uninstall", [] { return CachingHostAllocator::get().uninstall(); },
        "restore the allocator installed before; False when this one is not installed");
  m.def("installed", [] { return CachingHostAllocator::get().installed(); });
  m.def("empty_cache", [] { return CachingHostAllocator::get().empty_cache(); },
        "unmap every cached block; returns the bytes released");
  m.def("stats", [] {
    const auto s = CachingHostAllocator::get().stats();  // the lock is released here
    py::dict d;
    d["installed"] = s.installed;
    d["fraction"] = s.fraction;
    d["min_bytes"] = s.min_bytes;
    d["floor_bytes"] = s.floor_bytes;
    d["ceiling_bytes"] = s.ceiling_bytes;
    d["limit_bytes"] = s.limit_bytes;
    d["huge_bytes"] = s.huge_bytes;
    d["allocs"] = s.allocs;
    d["hits"] = s.hits;
    d["maps"] = s.maps;
    d["unmaps"] = s.unmaps;
    d["mapped_bytes"] = s.mapped_bytes;
    d["in_use_bytes"] = s.in_use_bytes;
    d["cached_bytes"] = s.cached_bytes;
    d["cached_blocks"] = s.cached_blocks;
    d["peak_cached_bytes"] = s.peak_cached_bytes;
    d["peak_in_use_bytes"] = s.peak_in_use_bytes;
    d["bytes_reused"] = s.bytes_reused;
    return d;
  });
}
