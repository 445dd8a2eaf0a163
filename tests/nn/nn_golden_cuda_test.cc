// The golden checks (nn_golden_test.cc) on the cuda accelerator; SKIPPED
// without a GPU. Default activations on cuda are the parameter dtype.
#include "tests/nn/quant_checks.h"
#include "tests/nn/golden_checks.h"
#include "tests/support/tolerances.h"
#include "tests/support/test_paths.h"

using namespace strata;
using namespace strata::test;

TEST_CASE("golden on cuda: fp32 Llama matches transformers", "[nn][golden][cuda]") {
  for (const char* name : {"llama_untied_f32", "llama_tied_f32"}) {
    check_golden(Backend::kCuda, name, "loss", "grads.safetensors", kGoldenF32Cuda);
  }
}

TEST_CASE("golden on cuda: bf16 Llama matches transformers in bf16", "[nn][golden][cuda]") {
  for (const char* name : {"llama_untied_bf16", "llama_tied_bf16"}) {
    check_golden(Backend::kCuda, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    check_golden(Backend::kCuda, name, "loss_f32", "grads_f32.safetensors", kGoldenF32Cuda,
                 DType::kF32);
  }
}

TEST_CASE("golden on cuda: Llama 3.1, Mistral, Qwen2, Qwen3 and YaRN Llama and Qwen2 match transformers", "[nn][golden][cuda]") {
  for (const char* family : {"llama3", "mistral", "qwen2", "qwen3", "llama_yarn", "qwen2_yarn"}) {
    check_golden(Backend::kCuda, std::string(family) + "_untied_f32", "loss", "grads.safetensors", kGoldenF32Cuda);
    const std::string tied = std::string(family) + "_tied_bf16";
    check_golden(Backend::kCuda, tied, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    check_golden(Backend::kCuda, tied, "loss_f32", "grads_f32.safetensors", kGoldenF32Cuda, DType::kF32);
  }
}

TEST_CASE("golden on cuda: a packed batch equals transformers fed its documents one by one",
          "[nn][golden][cuda][packed]") {
  for (const char* name : {"llama_untied_f32_packed", "mistral_untied_f32_packed"}) {
    check_golden(Backend::kCuda, name, "loss", "grads.safetensors", kGoldenF32Cuda);
  }
}

TEST_CASE("golden on cuda: LoRA adapters match PEFT", "[nn][golden][cuda][lora]") {
  for (const char* name : {"lora_llama_f32_all", "lora_llama_f32_qv_rslora", "lora_qwen2_f32_attn", "lora_gemma3_f32_all"}) {
    check_lora_golden(Backend::kCuda, name, "loss", "grads.safetensors", kGoldenF32Cuda);
  }
  check_lora_golden(Backend::kCuda, "lora_llama_bf16_all", "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
}

TEST_CASE("golden on cuda: Mixtral, Qwen3-MoE and Qwen2-MoE match transformers, with and without the auxiliary loss",
          "[nn][golden][cuda][moe]") {
  for (const char* name :
       {"mixtral_untied_f32", "qwen3_moe_untied_f32", "qwen3_moe_nonorm_f32", "qwen2_moe_untied_f32"}) {
    check_golden(Backend::kCuda, name, "loss", "grads.safetensors", kGoldenF32Cuda);
    GoldenRun off;
    off.router_logits_off = true;
    check_golden_run(Backend::kCuda, name, "loss_without_aux", "", kGoldenF32Cuda, off);
  }
  for (const char* name : {"mixtral_untied_bf16", "qwen3_moe_tied_bf16", "qwen2_moe_tied_bf16"}) {
    check_golden(Backend::kCuda, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    check_golden(Backend::kCuda, name, "loss_f32", "grads_f32.safetensors", kGoldenF32Cuda, DType::kF32);
  }
}

TEST_CASE("golden on cuda: Gemma 2 and Gemma 3 match transformers", "[nn][golden][cuda][gemma]") {
  for (const char* family : {"gemma2", "gemma3"}) {
    check_golden(Backend::kCuda, std::string(family) + "_untied_f32", "loss", "grads.safetensors", kGoldenF32Cuda);
    const std::string tied = std::string(family) + "_tied_bf16";
    check_golden(Backend::kCuda, tied, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    check_golden(Backend::kCuda, tied, "loss_f32", "grads_f32.safetensors", kGoldenF32Cuda, DType::kF32);
  }
}

// scripts/make-golden-gptoss's fixtures (nn_golden_test.cc): attention sinks
// in the flash kernels and their gradient, a sliding layer and a full one,
// YaRN, biases, the biased router and the clamped SwiGLU experts.
TEST_CASE("golden on cuda: gpt-oss matches transformers, its attention sinks on the flash kernels",
          "[nn][golden][cuda][gpt_oss]") {
  check_golden(Backend::kCuda, "gpt_oss_untied_f32", "loss", "grads.safetensors", kGoldenF32Cuda);
  check_golden(Backend::kCuda, "gpt_oss_untied_bf16", "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
  check_golden(Backend::kCuda, "gpt_oss_untied_bf16", "loss_f32", "grads_f32.safetensors", kGoldenF32Cuda,
               DType::kF32);
}

TEST_CASE("golden on cuda: FP8 blocks dequantize to transformers' bits, as the cpu kernel does",
          "[nn][golden][cuda][quant]") {
  // Every FP8 weight of the DeepSeek fixture (ragged blocks) through
  // Ops::dequantize_fp8_blocks on the device, fp32 and bf16.
  Rig rig(Backend::kCuda);
  CHECK(check_fp8_dequantize_golden(rig, Fp8Fixture()) == 22);
}

TEST_CASE("golden on cuda: MXFP4 blocks dequantize to transformers' bits, as the cpu kernel does",
          "[nn][golden][cuda][quant]") {
  // gpt-oss's kept expert form through Ops::dequantize_mxfp4_blocks on the device, fp32, bf16 and fp16.
  Rig rig(Backend::kCuda);
  CHECK(check_mxfp4_dequantize_golden(rig) == 3);
}
