// strata's loss and every gradient against Hugging Face transformers on the
// cpu accelerator (fixtures from scripts/make-golden; tolerances justified in
// golden_tolerances.h).
#include "tests/nn/golden_checks.h"
#include "tests/nn/golden_tolerances.h"

using namespace strata;
using namespace strata::test;

TEST_CASE("golden: fp32 Llama (GQA, untied and tied) matches transformers", "[nn][golden]") {
  for (const char* name : {"llama_untied_f32", "llama_tied_f32"}) {
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32);
  }
}

TEST_CASE("golden: bf16 storage matches transformers on the same 16-bit weights",
          "[nn][golden]") {
  for (const char* name : {"llama_untied_bf16", "llama_tied_bf16"}) {
    // fp32 arithmetic on bf16 weights: what the cpu ops compute, exactly.
    check_golden(Backend::kCpu, name, "loss_f32", "grads_f32.safetensors", kGoldenF32);
    // Against transformers computing in bf16 throughout.
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    // bf16 activations on the cpu, against transformers in bf16.
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16,
                 DType::kBF16);
  }
}
