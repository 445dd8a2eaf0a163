// MXFP4 on the host (kernels/mxfp4_blocks.h): the checkpoint reader's
// dequantization, the packing into the kept form, and the cpu backend's kernel.
#include "kernels/mxfp4_blocks.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>
#include <vector>

namespace strata::kernels {
namespace {

// Every (scale, code) value rounded once to a float storage dtype, as bits:
// index scale * 16 + code.
template <typename Bits>
std::vector<Bits> value_table(DType dtype) {
  std::vector<Bits> table(256 * 16);
  for (int s = 0; s < 256; ++s) {
    for (int c = 0; c < 16; ++c) {
      store_from_float(table.data(), dtype, static_cast<size_t>(s * 16 + c),
                       mxfp4_value(static_cast<uint8_t>(s), static_cast<uint8_t>(c)));
    }
  }
  return table;
}

const uint32_t* table_f32() {
  static const std::vector<uint32_t> t = value_table<uint32_t>(DType::kF32);
  return t.data();
}
const uint16_t* table_bf16() {
  static const std::vector<uint16_t> t = value_table<uint16_t>(DType::kBF16);
  return t.data();
}
const uint16_t* table_f16() {
  static const std::vector<uint16_t> t = value_table<uint16_t>(DType::kF16);
  return t.data();
}

// fn(table) with the value table of a float storage dtype.
template <typename Fn>
void with_table(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32: fn(table_f32()); return;
    case DType::kBF16: fn(table_bf16()); return;
    case DType::kF16: fn(table_f16()); return;
    default: return;  // callers validate: float storage only
  }
}

constexpr int64_t kTileCols = 64;

// The checkpoint form walked band by band (32 rows of one expert), tile by
// tile of columns: sink(index, codes, scales, count) for each run of `count`
// consecutive elements of one row from element `index` of [first, first +
// n), their codes and their columns' scales.
template <typename Sink>
void for_each_checkpoint_run(const uint8_t* blocks, const uint8_t* scales, const Mxfp4Stacked& s, int64_t first,
                             int64_t n, Sink&& sink) {
  if (n <= 0) return;
  const int64_t cols = s.width, groups = s.in / 32, band = 32 * cols, end = first + n;
  uint8_t bytes[kTileCols][16];
  uint8_t tile_scales[kTileCols];
  uint8_t codes[kTileCols];
  for (int64_t b = first / band; b * band < end; ++b) {
    const int64_t e = b / groups, g = b % groups, base = b * band;
    const int64_t lo = std::max(first, base) - base, hi = std::min(end, base + band) - base;  // within the band
    const int64_t row_lo = lo / cols, row_hi = (hi - 1) / cols;                               // rows touched
    for (int64_t c0 = 0; c0 < cols; c0 += kTileCols) {
      const int64_t c1 = std::min(cols, c0 + kTileCols);
      bool decoded = false;  // the tile's bytes and scales, read when a touched row needs them
      for (int64_t r = row_lo; r <= row_hi; ++r) {
        const int64_t from = std::max(c0, r == row_lo ? lo % cols : 0);
        const int64_t to = std::min(c1, r == row_hi ? (hi - 1) % cols + 1 : cols);
        if (from >= to) continue;
        if (!decoded) {
          // The tile's columns some touched row reads: a range within one row reads its own only.
          const int64_t d0 = row_lo == row_hi ? from : c0, d1 = row_lo == row_hi ? to : c1;
          for (int64_t c = d0; c < d1; ++c) {
            const int64_t block = (e * cols + c) * groups + g;
            std::memcpy(bytes[c - c0], blocks + block * 16, 16);
            tile_scales[c - c0] = scales[block];
          }
          decoded = true;
        }
        const int64_t byte = r / 2;
        const int shift = static_cast<int>(r % 2) * 4;
        for (int64_t c = from; c < to; ++c) codes[c - c0] = static_cast<uint8_t>((bytes[c - c0][byte] >> shift) & 0x0f);
        sink(base + r * cols + from, codes + (from - c0), tile_scales + (from - c0), to - from);
      }
    }
  }
}

}  // namespace

float mxfp4_value(uint8_t scale, uint8_t code) {
  // torch.ldexp(x, e) is x * 2^e in fp32: 2^-127 a subnormal, 2^128 inf.
  const uint32_t bits = scale == 0 ? uint32_t{1} << 22 : scale == 255 ? 0x7f800000u : uint32_t{scale} << 23;
  return kFp4Values[code & 0x0f] * std::bit_cast<float>(bits);
}

void dequantize_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t first, int64_t n, void* dst,
                      DType dst_dtype) {
  if (n <= 0) return;
  with_table(dst_dtype, [&](const auto* table) {
    using Bits = std::remove_const_t<std::remove_pointer_t<decltype(table)>>;
    Bits* out = static_cast<Bits*>(dst);
    const int64_t base = first / 2, end = first + n;  // `codes` points at byte `base`
    const auto one = [&](int64_t i) {
      const int code = (codes[i / 2 - base] >> ((i % 2) * 4)) & 0x0f;
      out[i - first] = table[scales[i / 32] * 16 + code];
    };
    int64_t i = first;
    for (; i < end && i % 32 != 0; ++i) one(i);  // up to a block
    // Whole blocks: one scale's 16 values, 16 bytes giving 32 elements.
    for (; i + 32 <= end; i += 32) {
      const Bits* row = table + scales[i / 32] * 16;
      const uint8_t* b = codes + (i / 2 - base);
      Bits* o = out + (i - first);
      for (int j = 0; j < 16; ++j) {
        o[2 * j] = row[b[j] & 0x0f];
        o[2 * j + 1] = row[b[j] >> 4];
      }
    }
    for (; i < end; ++i) one(i);
  });
}

void dequantize_mxfp4_stacked(const uint8_t* blocks, const uint8_t* scales, const Mxfp4Stacked& s, int64_t first,
                              int64_t n, void* dst, DType dst_dtype) {
  with_table(dst_dtype, [&](const auto* table) {
    using Bits = std::remove_const_t<std::remove_pointer_t<decltype(table)>>;
    Bits* out = static_cast<Bits*>(dst);
    for_each_checkpoint_run(blocks, scales, s, first, n,
                            [&](int64_t index, const uint8_t* codes, const uint8_t* col_scales, int64_t count) {
                              Bits* o = out + (index - first);
                              for (int64_t k = 0; k < count; ++k) o[k] = table[col_scales[k] * 16 + codes[k]];
                            });
  });
}

void dequantize_mxfp4_columns(const uint8_t* blocks, const uint8_t* scales, const Mxfp4Stacked& s,
                              int64_t first_column, int64_t column_step, int64_t first, int64_t n, void* dst,
                              DType dst_dtype) {
  const int64_t in = s.in;
  const size_t esize = dtype_nbytes(dst_dtype);
  for (int64_t i = first, end = first + n; i < end;) {
    const int64_t row = i / in, j = i % in, len = std::min(end - i, in - j);
    const int64_t column = first_column + row * column_step;
    // The row's codes from element j's byte on, its scales from element 0's.
    dequantize_mxfp4(blocks + column * (in / 2) + j / 2, scales + column * (in / 32), j, len,
                     static_cast<char*>(dst) + static_cast<size_t>(i - first) * esize, dst_dtype);
    i += len;
  }
}

void pack_mxfp4_columns(const uint8_t* blocks, const uint8_t* scales, const Mxfp4Stacked& s, int64_t first_column,
                        int64_t column_step, int64_t rows, int64_t first, int64_t n, uint8_t* dst) {
  // Two runs of rows: the codes (in / 2 bytes a row), then the scales (in / 32).
  const int64_t in = s.in, packed = rows * in / 2;
  for (int64_t b = first, end = first + n; b < end;) {
    const bool codes = b < packed;
    const int64_t row_nbytes = codes ? in / 2 : in / 32, at = codes ? b : b - packed;
    const int64_t row = at / row_nbytes, off = at % row_nbytes;
    const int64_t len = std::min({end - b, row_nbytes - off, codes ? packed - b : end - b});
    const uint8_t* src = (codes ? blocks : scales) + (first_column + row * column_step) * row_nbytes + off;
    std::memcpy(dst + (b - first), src, static_cast<size_t>(len));
    b += len;
  }
}

}  // namespace strata::kernels
