// Weight memory in transparent huge pages (huge_pages.h). Compiled once with the bindings.
#include "huge_pages.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

namespace {

constexpr size_t kHugePage = size_t{2} << 20;
// Smaller packed weights (a small model's projections, a router) share chunks this big; a
// weight at least this big gets a chunk of its own.
constexpr size_t kChunk = size_t{16} << 20;
constexpr size_t kAlign = 64;  // every tensor starts on a cache line

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

struct Chunk {
  char* base = nullptr;
  size_t size = 0;
  size_t used = 0;
  explicit Chunk(size_t bytes) : size(round_up(bytes, kHugePage)) {
    base = static_cast<char*>(std::aligned_alloc(kHugePage, size));
    TORCH_CHECK(base != nullptr, "huge_zeros: out of memory for ", size, " bytes");
    // Advice before the first touch, so the page faults take huge pages (ignored where THP is
    // off); the zeroing below is that first touch.
    madvise(base, size, MADV_HUGEPAGE);
  }
  ~Chunk() { std::free(base); }
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;
};

std::mutex chunk_mutex;
std::shared_ptr<Chunk> shared_chunk;  // where small tensors go next

}  // namespace

at::Tensor huge_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const size_t bytes = round_up(std::max<size_t>(numel * c10::elementSize(dtype), 1), kAlign);
  std::shared_ptr<Chunk> chunk;
  char* data = nullptr;
  if (bytes >= kChunk) {
    chunk = std::make_shared<Chunk>(bytes);
    data = chunk->base;
  } else {
    const std::lock_guard<std::mutex> lock(chunk_mutex);
    if (shared_chunk == nullptr || shared_chunk->used + bytes > shared_chunk->size)
      shared_chunk = std::make_shared<Chunk>(kChunk);
    chunk = shared_chunk;
    data = chunk->base + chunk->used;
    chunk->used += bytes;
  }
  std::memset(data, 0, bytes);
  return at::from_blob(data, sizes, [chunk](void*) {}, at::TensorOptions().dtype(dtype));
}
