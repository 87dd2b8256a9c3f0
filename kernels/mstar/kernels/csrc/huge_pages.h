// Weights in transparent huge pages: a batch-1 decode step streams every weight once, and on
// the VMs this runs on a 4 KiB page walk per 4 KiB of weight costs a fifth of DRAM bandwidth.
// Measured on a 2-core Zen 4 VM, one row times 16 layers of hidden-1,024 / MLP-3,072 panels
// (386 MB, two threads): 27 GB/s on 4 KiB pages, 35 GB/s on 2 MiB pages (llama.cpp's mmapped
// GGUF gets large folios from the page cache, hence its lead at batch 1). Declared for the
// packing bindings.
#pragma once

#include <ATen/core/Tensor.h>

// A zeroed contiguous CPU tensor carved from 2 MiB-aligned chunks the kernel is asked
// (madvise MADV_HUGEPAGE) to back with huge pages; small tensors share a chunk, which is freed
// with its last tensor. Where the kernel gives no huge page the memory is ordinary.
at::Tensor huge_zeros(at::IntArrayRef sizes, at::ScalarType dtype);
