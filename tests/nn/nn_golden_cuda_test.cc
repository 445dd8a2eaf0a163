// The golden checks (nn_golden_test.cc) on the cuda accelerator; SKIPPED
// without a GPU. Default activations on cuda are the parameter dtype.
#include "tests/nn/golden_checks.h"
#include "tests/nn/golden_tolerances.h"

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
