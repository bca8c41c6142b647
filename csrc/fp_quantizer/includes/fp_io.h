// ds_fpquant element I/O: the fp32 / fp16 / bf16 tensors the kernels read and write (SPEC 2: inputs are
// widened to fp32 exactly; SPEC 5: outputs are rounded to nearest even, fp16 overflow gives Inf), shared
// by the CPU and CUDA kernels like the codec (fp_codec.h, whose fp32 helpers this uses). No torch includes.
#pragma once

#include <cstdint>

#include "fp_codec.h"

namespace fpq {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ---------------------------------------------------------------------------------------------
// 16-bit float conversions (exact widening; RNE narrowing as IEEE and torch do)
// ---------------------------------------------------------------------------------------------
FPQ_HD float bf16_bits_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

FPQ_HD float fp16_bits_to_f32(uint16_t h)
{
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    // fp16 exponent+mantissa placed in an fp32 and scaled by 2^112 re-biases normals and
    // normalises subnormals exactly; the all-ones exponent (Inf/NaN) is mapped directly.
    const float scaled = mul_rn(bits_f32(em << 13), bits_f32(uint32_t(112 + kF32Bias) << kF32ManBits));
    const uint32_t mag = em >= 0x7c00u ? (kF32InfBits | ((em & 0x3ffu) << 13)) : f32_bits(scaled);
    return bits_f32(sign | mag);
}

FPQ_HD uint16_t f32_to_bf16_bits(float f)
{
    const uint32_t u = f32_bits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // RNE; Inf stays Inf
    return uint16_t((u & kF32AbsMask) > kF32InfBits ? 0x7fc0u : rounded);  // NaN -> quiet NaN
}

// fp32 -> fp16 with RNE, subnormals and overflow to Inf (the classic FP16 library algorithm).
FPQ_HD uint16_t f32_to_fp16_bits(float f)
{
    const float scale_to_inf = bits_f32(0x77800000u);   // 2^112
    const float scale_to_zero = bits_f32(0x08800000u);  // 2^-110
    float base = mul_rn(mul_rn(bits_f32(f32_bits(f) & kF32AbsMask), scale_to_inf), scale_to_zero);
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = add_rn(bits_f32((bias >> 1) + 0x07800000u), base);
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007c00u;
    const uint32_t mantissa_bits = bits & 0x00000fffu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return uint16_t((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

struct Fp16 { uint16_t bits; };
struct Bf16 { uint16_t bits; };

FPQ_HD float load_f32(float v) { return v; }
FPQ_HD float load_f32(Fp16 v) { return fp16_bits_to_f32(v.bits); }
FPQ_HD float load_f32(Bf16 v) { return bf16_bits_to_f32(v.bits); }

template <class T>
FPQ_HD T store_from_f32(float f);
template <>
FPQ_HD float store_from_f32<float>(float f) { return f; }
template <>
FPQ_HD Fp16 store_from_f32<Fp16>(float f) { return Fp16{f32_to_fp16_bits(f)}; }
template <>
FPQ_HD Bf16 store_from_f32<Bf16>(float f) { return Bf16{f32_to_bf16_bits(f)}; }

}  // namespace fpq
