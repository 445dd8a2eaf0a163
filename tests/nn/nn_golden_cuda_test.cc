// The golden checks (nn_golden_test.cc) on the cuda accelerator; SKIPPED
// without a GPU. Default activations on cuda are the parameter dtype.
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

TEST_CASE("golden on cuda: FP8 blocks dequantize to transformers' bits, as the cpu kernel does",
          "[nn][golden][cuda][quant]") {
  // Every FP8 weight of the DeepSeek fixture (ragged blocks) through
  // Ops::dequantize_fp8_blocks on the device, fp32 and bf16.
  const std::string dir = strata::test::source_dir() + "/tests/data/golden/fp8_deepseek_v3/";
  const nn::SafetensorsFile want = nn::SafetensorsFile::open(dir + "dequantized.safetensors");
  std::vector<nn::SafetensorsFile> shards;
  for (const char* f : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
    shards.push_back(nn::SafetensorsFile::open(dir + f));
  }
  const auto find = [&](const std::string& name) {
    for (const auto& s : shards) {
      if (s.contains(name)) return s.view(name);
    }
    FAIL("no tensor " << name);
    return TensorView{};
  };
  Rig rig(Backend::kCuda);
  Stream& stream = rig.engine->compute_stream();
  const auto upload = [&](const TensorView& host) {
    Tensor t = rig.accelerator->allocate_tensor(host.desc.dtype, host.desc.shape);
    rig.accelerator->copy_async(t.data(), host.data, host.nbytes(), CopyKind::kHostToDevice, stream);
    stream.synchronize();
    return t;
  };
  int checked = 0;
  for (const std::string& name : want.names()) {
    if (!name.ends_with(".f32")) continue;
    const std::string weight = name.substr(0, name.size() - 4);
    INFO(weight);
    const Tensor w = upload(find(weight)), s = upload(find(weight + "_scale_inv"));
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      Tensor out = rig.accelerator->allocate_tensor(dtype, w.view().desc.shape);
      rig.engine->ops().dequantize_fp8_blocks(rig.engine->compute(), w.view(), s.view(), 128, 128, out.view());
      std::vector<uint8_t> got(out.view().nbytes());
      rig.accelerator->copy_async(got.data(), out.data(), got.size(), CopyKind::kDeviceToHost, stream);
      stream.synchronize();
      const TensorView golden = want.view(weight + (dtype == DType::kF32 ? ".f32" : ".bf16"));
      const auto* g = static_cast<const uint8_t*>(golden.data);
      CHECK(got == std::vector<uint8_t>(g, g + golden.nbytes()));
    }
    ++checked;
  }
  CHECK(checked == 22);
}
