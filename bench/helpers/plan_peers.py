"""Published tokens/s of other MoE offloading engines, for the plan.md benchmark table.

These are numbers other projects and users PUBLISH for their own engines (kTransformers,
llama.cpp, mixtral-offloading, MoE-Infinity, Fiddler, vLLM, SGLang). They were gathered on
2026-11-26 from the cited sources (GitHub blobs/issues/PRs, papers, blog pages) and were
NOT measured here. Nothing was derived: a figure given as a range stays a range, a figure
not published is None (e.g. per-token latency is not converted to tokens/s).

Keys of each row:
  model      one of "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b (mxfp4)",
             "deepseek-v3 (fp8)", "deepseek-v3 (int4)", "kimi-k2 (int4)", "glm-4.5-air"
             (4-bit GGUF such as Q4_K_M of DeepSeek-V3/R1 -> "deepseek-v3 (int4)"; the real
             quantization is in "quantization")
  target     "h100", "rtx4090", "4xh100", "8xh100", or "other" (the card is then in "gpu")
  engine, quantization, gpu, cpu, setting (what was offloaded / flags / batch / context)
  decode_tokens_per_s, prefill_tokens_per_s   number, [low, high], or None
  source     URL;  quote  <= 200 chars from the source with the number

Caveats worth keeping next to the table:
  * No source found gives GPT-OSS-120B, Qwen3-30B-A3B, Qwen3-235B-A22B or GLM-4.5-Air
    tokens/s for a single H100 or a single RTX 4090 with experts on CPU; the closest rows
    (RTX 3090, RTX 5090, an unnamed "consumer-grade GPU") are kept with target "other".
  * The kTransformers "6 experts" rows activate 6 instead of 8 routed experts (a different
    computation than the model as released); use the 8-expert rows for a like-for-like table.
  * Decode figures measured with many concurrent requests are aggregate output throughput,
    not single-stream speed; "setting" says which.
"""

_KT_DS = "https://github.com/kvcache-ai/ktransformers/blob/main/doc/en/DeepseekR1_V3_tutorial.md"
_KT_CPU_2S = "2x Intel Xeon Gold 6454S (32 cores/socket), 1 TB DDR5-4800, 8 channels/socket"
_MIXOFF = "https://arxiv.org/abs/2312.17238"
_MIXOFF_Q = (
    "Table 2: Inference speed for Mixtral-8x7B in low-tier, measured in tokens per second. "
    "Full algorithm | 3.061 | 2.655 | 2.278 | 2.092 (2-bit experts: A100, 3080 Mobile, 3060, T4)"
)

PEERS = [
    # ---------------- kTransformers, DeepSeek-V3/R1 Q4_K_M, one 4090D / 4090 ----------------
    {
        "model": "deepseek-v3 (int4)",
        "target": "rtx4090",
        "engine": "kTransformers v0.2 (dual socket, 8 experts)",
        "quantization": "GGUF Q4_K_M (DeepseekV3-q4km)",
        "gpu": "RTX 4090D 24 GB (4090-class, China variant)",
        "cpu": _KT_CPU_2S,
        "setting": "routed experts on CPU (llamafile kernels), MLA/KV on GPU; 500-token prompt; "
        "after warm-up; batch 1",
        "decode_tokens_per_s": 12.208,
        "prefill_tokens_per_s": 82.94,
        "source": _KT_DS + " (section V0.2, Benchmark Results)",
        "quote": "Dual socket Ktrans (8 experts) ... Prefill token/s | 82.94 ... Decode token/s | 12.208",
    },
    {
        "model": "deepseek-v3 (int4)",
        "target": "rtx4090",
        "engine": "kTransformers v0.2 (single socket, 8 experts)",
        "quantization": "GGUF Q4_K_M (DeepseekV3-q4km)",
        "gpu": "RTX 4090D 24 GB (4090-class, China variant)",
        "cpu": "1x Intel Xeon Gold 6454S (32 cores), 382 GB DRAM used",
        "setting": "routed experts on CPU, MLA/KV on GPU; 500-token prompt; batch 1",
        "decode_tokens_per_s": 8.73,
        "prefill_tokens_per_s": 54.21,
        "source": _KT_DS + " (section V0.2, Benchmark Results)",
        "quote": "Single socket Ktrans (8 experts) ... Prefill token/s ... 54.21 ... Decode token/s ... 8.73",
    },
    {
        "model": "deepseek-v3 (int4)",
        "target": "rtx4090",
        "engine": "kTransformers v0.2 (dual socket, 6 experts = reduced activation)",
        "quantization": "GGUF Q4_K_M (DeepseekV3-q4km)",
        "gpu": "RTX 4090D 24 GB (4090-class, China variant)",
        "cpu": _KT_CPU_2S,
        "setting": "6 of 8 routed experts activated (V0.3 preview trick, not the released model); "
        "experts on CPU; 500-token prompt",
        "decode_tokens_per_s": 13.69,
        "prefill_tokens_per_s": 97.32,
        "source": _KT_DS + " (section V0.2, Benchmark Results)",
        "quote": "Dual socket Ktrans (6 experts) ... Prefill token/s | 97.32 ... Decode token/s | 13.69",
    },
    {
        "model": "deepseek-v3 (int4)",
        "target": "rtx4090",
        "engine": "llama.cpp (as measured by the kTransformers team, 8 experts)",
        "quantization": "GGUF Q4_K_M",
        "gpu": "RTX 4090D 24 GB (4090-class, China variant)",
        "cpu": _KT_CPU_2S,
        "setting": "2x32 cores; llama.cpp offload flags not stated in the source; 500-token prompt",
        "decode_tokens_per_s": 4.51,
        "prefill_tokens_per_s": 10.31,
        "source": _KT_DS + " (section V0.2, Benchmark Results, last column)",
        "quote": "Compared to 10.31 tokens/s in llama.cpp with 2x32 cores ... Compared to 4.51 tokens/s "
        "in llama.cpp with 2x32 cores",
    },
    {
        "model": "deepseek-v3 (int4)",
        "target": "rtx4090",
        "engine": "kTransformers v0.2.1 (dual socket, 8 experts)",
        "quantization": "GGUF Q4_K_M (DeepseekV3-q4km)",
        "gpu": "RTX 4090 24 GB",
        "cpu": _KT_CPU_2S,
        "setting": "experts on CPU; prompts 1K-8K tokens (969-7678), 300 output tokens; "
        "range over prompt lengths; doc says platform moved 4090D->4090",
        "decode_tokens_per_s": [12.4, 13.5],
        "prefill_tokens_per_s": [80.0, 88.5],
        "source": _KT_DS + " (section V0.2.1, Benchmark Results, '8 experts V0.2.1')",
        "quote": "8 experts V0.2.1 | Prefill token/s | 12.2 | 88.2 | 88.5 | 81.9 | 80 | "
        "Decode token/s | 13.4 | 13.5 | 13.4 | 13.2 | 12.4",
    },
    {
        "model": "deepseek-v3 (int4)",
        "target": "other",
        "engine": "kTransformers v0.3-preview (AMX, 8 experts)",
        "quantization": "DeepseekV3-BF16 quantized online: int8 CPU experts, int4 GPU",
        "gpu": "(1~4)x RTX 4090D 24 GB (count per row not stated)",
        "cpu": _KT_CPU_2S + "; 644 GB DRAM used",
        "setting": "prompts 1K/2K/4K/8K; decode not reported ('same as V0.2 (6 experts)')",
        "decode_tokens_per_s": None,
        "prefill_tokens_per_s": [185.96, 255.26],
        "source": _KT_DS + " (section V0.3-Preview, Benchmark results)",
        "quote": "KTrans (8 experts) Prefill token/s | 185.96 | 255.26 | 252.58 | 195.62",
    },
    {
        "model": "deepseek-v3 (int4)",
        "target": "rtx4090",
        "engine": "kTransformers (user report)",
        "quantization": "GGUF Q4_K_M (DeepSeek-R1)",
        "gpu": "RTX 4090 24 GB",
        "cpu": "Intel Xeon Gold 6133 @ 2.50GHz, 502 GiB RAM",
        "setting": "kTransformers local deployment, experts on CPU; prefill shown only as a screenshot",
        "decode_tokens_per_s": 4.5,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/kvcache-ai/ktransformers/issues/573",
        "quote": "本地部署 deepseek-R1/Q4_K_M. eval rate:4.5tokens/s ... GPU: NVIDIA GeForce RTX 4090",
    },
    {
        "model": "deepseek-v3 (fp8)",
        "target": "other",
        "engine": "kTransformers kt-kernel + SGLang",
        "quantization": "DeepSeek-R1-0528 FP8",
        "gpu": "8x NVIDIA L20",
        "cpu": "Intel Xeon Gold 6454S",
        "setting": "CPU/GPU hybrid experts; 8-way concurrency; decode = aggregate output throughput; "
        "227.85 tok/s is total (input+output) throughput",
        "decode_tokens_per_s": 87.58,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/kvcache-ai/ktransformers/blob/main/README.md (Performance Examples)",
        "quote": "| DeepSeek-R1-0528 (FP8) | 8xL20 GPU + Xeon Gold 6454S | 227.85 tokens/s | "
        "87.58 tokens/s (8-way concurrency) |",
    },
    # ---------------- kTransformers, Kimi K2 ----------------
    {
        "model": "kimi-k2 (int4)",
        "target": "other",
        "engine": "kTransformers (single socket)",
        "quantization": "GGUF Q4_K_M (Kimi-K2 / Kimi-K2-0905)",
        "gpu": "one consumer-grade GPU (model not named)",
        "cpu": "single-socket CPU, ~600 GB DRAM",
        "setting": "experts on CPU; 'roughly'",
        "decode_tokens_per_s": 10,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/kvcache-ai/ktransformers/blob/main/doc/en/Kimi-K2.md",
        "quote": "On a single-socket CPU with one consumer-grade GPU, running the Q4_K_M model yields "
        "roughly 10 TPS and requires about 600 GB of DRAM.",
    },
    {
        "model": "kimi-k2 (int4)",
        "target": "other",
        "engine": "kTransformers (dual socket, NUMA)",
        "quantization": "GGUF Q4_K_M (Kimi-K2 / Kimi-K2-0905)",
        "gpu": "one consumer-grade GPU (model not named)",
        "cpu": "dual-socket CPU",
        "setting": "experts on CPU; NUMA optimizations on; 'about'",
        "decode_tokens_per_s": 14,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/kvcache-ai/ktransformers/blob/main/doc/en/Kimi-K2.md",
        "quote": "With a dual-socket CPU and sufficient system memory, enabling NUMA optimizations "
        "increases performance to about 14 TPS.",
    },
    {
        "model": "kimi-k2 (int4)",
        "target": "other",
        "engine": "kTransformers kt-kernel + SGLang (bench_serving)",
        "quantization": "Kimi-K2-Thinking, AMX INT4 CPU expert weights",
        "gpu": "8x NVIDIA L20",
        "cpu": "Intel Xeon Gold 6454S",
        "setting": "prefill: 37 prompts x 1024 in, 1 out (concurrency ~23); decode: 37 prompts x 10 in, "
        "512 out, 37 concurrent -> aggregate output throughput",
        "decode_tokens_per_s": 45.91,
        "prefill_tokens_per_s": 577.74,
        "source": "https://github.com/kvcache-ai/ktransformers/blob/main/doc/en/Kimi-K2-Thinking.md",
        "quote": "GPUs: 8x NVIDIA L20 ... Input token throughput (tok/s): 577.74 ... "
        "Output token throughput (tok/s): 45.91",
    },
    {
        "model": "kimi-k2 (int4)",
        "target": "other",
        "engine": "kTransformers kt-kernel + SGLang (native INT4)",
        "quantization": "Kimi-K2-Thinking native INT4 (RAWINT4, same weights CPU and GPU)",
        "gpu": "1x RTX 4090 48 GB (48 GB variant, not the stock 24 GB card)",
        "cpu": "2x Intel Xeon Platinum 8488C, 2 TB DDR5-4800",
        "setting": "kt-num-gpu-experts 0; single concurrency; prompts 2048/8192/30000 tokens "
        "(30000 because 32768 OOMs); decode not reported",
        "decode_tokens_per_s": None,
        "prefill_tokens_per_s": [53, 290],
        "source": "https://github.com/kvcache-ai/ktransformers/blob/15c624dcaeabddcf4cba83756737d9df22a6adf1"
        "/doc/en/kt-kernel/Kimi-K2-Thinking-Native.md (Performance)",
        "quote": "| 1x RTX 4090 (48GB) | 53 | 184 | 290* | ... 1x RTX 4090 with layerwise prefill OOMs at "
        "32768 tokens, so the 290 tokens/s is measured with qlen=30000",
    },
    # ---------------- kTransformers, GLM-4.5-Air ----------------
    {
        "model": "glm-4.5-air",
        "target": "other",
        "engine": "kTransformers",
        "quantization": "bf16",
        "gpu": "one consumer-grade GPU (model not named), 14 GB GPU memory needed",
        "cpu": "dual-socket CPU, ~440 GB DRAM",
        "setting": "experts on CPU; approximate",
        "decode_tokens_per_s": 11,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/kvcache-ai/ktransformers/blob/main/doc/en/SmallThinker_and_Glm4moe.md",
        "quote": "GLM-4.5-Air (bf16): ~11 TPS on a dual-socket CPU with one consumer-grade GPU, "
        "requiring ~440 GB DRAM.",
    },
    {
        "model": "glm-4.5-air",
        "target": "other",
        "engine": "kTransformers (AMX INT8)",
        "quantization": "AMX INT8",
        "gpu": "one consumer-grade GPU (model not named), 14 GB GPU memory needed",
        "cpu": "dual-socket CPU, ~220 GB DRAM",
        "setting": "experts on CPU (AMX); approximate",
        "decode_tokens_per_s": 16,
        "prefill_tokens_per_s": 309,
        "source": "https://github.com/kvcache-ai/ktransformers/blob/main/doc/en/SmallThinker_and_Glm4moe.md",
        "quote": "GLM-4.5-Air (AMX INT8): prefill ~309 TPS / decode ~16 TPS on a dual-socket CPU with "
        "one consumer-grade GPU, requiring ~220 GB DRAM.",
    },
    # ---------------- GPT-OSS-120B ----------------
    {
        "model": "gpt-oss-120b (mxfp4)",
        "target": "other",
        "engine": "llama.cpp (llama-server)",
        "quantization": "gpt-oss-120b GGUF (MXFP4 experts)",
        "gpu": "RTX 3090 24 GB",
        "cpu": "AMD EPYC 7343, 64 GB DDR4-3200",
        "setting": "--n-gpu-layers 99 --n-cpu-moe 27 (27 MoE layers in RAM); context 85-5500 tokens; "
        "range over those lengths",
        "decode_tokens_per_s": [1.41, 1.81],
        "prefill_tokens_per_s": [48.49, 246.18],
        "source": "https://www.hardware-corner.net/gpt-oss-offloading-moe-layers/",
        "quote": "85 tokens 48.49 t/s 1.81 t/s / 500 tokens 173.60 t/s 1.57 t/s / 1400 tokens 229.07 t/s "
        "1.61 t/s / 5500 tokens 246.18 t/s 1.41 t/s",
    },
    {
        "model": "gpt-oss-120b (mxfp4)",
        "target": "other",
        "engine": "llama.cpp (llama-server v7481, -fit on)",
        "quantization": "Q4_K_M GGUF (as stated; 60 GB)",
        "gpu": "RTX 5090 32 GB",
        "cpu": "AMD Ryzen 9 9900X, 64 GB DDR5-5600",
        "setting": "all 37 layers on GPU, 22 layers' MoE expert weights spill to CPU via mmap; "
        "single request. User tech report in a ktransformers commit not on main",
        "decode_tokens_per_s": 44.2,
        "prefill_tokens_per_s": 63.1,
        "source": "https://github.com/kvcache-ai/ktransformers/blob/1f634203577abc1a186712713577b2f873a13446"
        "/doc/en/kt-kernel/GPT-OSS-120B-Kernel-Work.md (section 12.3)",
        "quote": "| Generation speed (single) | 44.2 t/s | ... | Prompt processing | 63.1 t/s |",
    },
    {
        "model": "gpt-oss-120b (mxfp4)",
        "target": "other",
        "engine": "kTransformers kt-kernel + SGLang (BF16 AMX path)",
        "quantization": "MXFP4 experts converted to BF16 (214 GB)",
        "gpu": "RTX 5090 32 GB",
        "cpu": "AMD Ryzen 9 9900X (AVX-512 BF16), 64 GB DDR5-5600",
        "setting": "all experts on CPU in BF16 (mmap); same user report as the row above",
        "decode_tokens_per_s": 0.23,
        "prefill_tokens_per_s": [0.04, 0.54],
        "source": "https://github.com/kvcache-ai/ktransformers/blob/1f634203577abc1a186712713577b2f873a13446"
        "/doc/en/kt-kernel/GPT-OSS-120B-Kernel-Work.md (section 9)",
        "quote": "Decode: 0.23 t/s / Prefill: 0.04-0.54 t/s (variable, depends on sequence length)",
    },
    # ---------------- Mixtral-8x7B ----------------
    {
        "model": "mixtral-8x7b",
        "target": "other",
        "engine": "mixtral-offloading (full algorithm: LRU cache + speculative prefetch)",
        "quantization": "HQQ 4-bit attention, 2-bit experts",
        "gpu": "A100-80GB-SXM",
        "cpu": None,
        "setting": "experts offloaded to host RAM, k=4 cached experts/layer; batch 1; "
        "OpenAssistant prompts",
        "decode_tokens_per_s": 3.061,
        "prefill_tokens_per_s": None,
        "source": _MIXOFF + " (Table 2)",
        "quote": _MIXOFF_Q,
    },
    {
        "model": "mixtral-8x7b",
        "target": "other",
        "engine": "mixtral-offloading (full algorithm)",
        "quantization": "HQQ 4-bit attention, 2-bit experts",
        "gpu": "RTX 3080 Mobile 16 GB (PCIe Gen.4)",
        "cpu": None,
        "setting": "experts offloaded to host RAM, k=4; batch 1",
        "decode_tokens_per_s": 2.655,
        "prefill_tokens_per_s": None,
        "source": _MIXOFF + " (Table 2)",
        "quote": _MIXOFF_Q,
    },
    {
        "model": "mixtral-8x7b",
        "target": "other",
        "engine": "mixtral-offloading (full algorithm)",
        "quantization": "HQQ 4-bit attention, 2-bit experts",
        "gpu": "RTX 3060 12 GB (PCIe Gen.3)",
        "cpu": None,
        "setting": "experts offloaded to host RAM, k=2; batch 1",
        "decode_tokens_per_s": 2.278,
        "prefill_tokens_per_s": None,
        "source": _MIXOFF + " (Table 2)",
        "quote": _MIXOFF_Q,
    },
    {
        "model": "mixtral-8x7b",
        "target": "other",
        "engine": "mixtral-offloading (full algorithm)",
        "quantization": "HQQ 4-bit attention, 2-bit experts",
        "gpu": "T4 16 GB (free Colab, PCIe Gen.3)",
        "cpu": None,
        "setting": "experts offloaded to host RAM, k=4; batch 1",
        "decode_tokens_per_s": 2.092,
        "prefill_tokens_per_s": None,
        "source": _MIXOFF + " (Table 2)",
        "quote": _MIXOFF_Q,
    },
    {
        "model": "mixtral-8x7b",
        "target": "other",
        "engine": "mixtral-offloading (full algorithm)",
        "quantization": "HQQ 4-bit attention, 3-bit experts",
        "gpu": "A100-80GB-SXM",
        "cpu": None,
        "setting": "experts offloaded to host RAM, k=4; batch 1",
        "decode_tokens_per_s": 2.845,
        "prefill_tokens_per_s": None,
        "source": _MIXOFF + " (Table 2)",
        "quote": "Table 2 ... 3-bit Experts ... Full algorithm | ... | 2.845 | 2.475 | 2.038 | 1.603",
    },
    {
        "model": "mixtral-8x7b",
        "target": "other",
        "engine": "HF Accelerate naive offloading (baseline in the mixtral-offloading paper)",
        "quantization": "HQQ 4-bit attention, 2-bit experts",
        "gpu": "A100-80GB-SXM",
        "cpu": None,
        "setting": "whole MoE layer loaded per step (device_map offload); batch 1",
        "decode_tokens_per_s": 1.392,
        "prefill_tokens_per_s": None,
        "source": _MIXOFF + " (Table 2)",
        "quote": "Naive offloading (accelerate) | 1.392 | 1.059 | 0.919 | 0.661 (2-bit experts: A100, "
        "3080 Mobile, 3060, T4)",
    },
    {
        "model": "mixtral-8x7b",
        "target": "other",
        "engine": "llama.cpp (maintainer comment)",
        "quantization": "GGUF q4_K_M",
        "gpu": "RTX 3090 24 GB",
        "cpu": None,
        "setting": "layer split, 28 layers on GPU (not expert offload); 5 t/s with no layers offloaded",
        "decode_tokens_per_s": 24,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/ggml-org/llama.cpp/issues/4729",
        "quote": "with llama.cpp I get 5 t/s for Mixtral q4_K_M on a consumer GPU without even offloading "
        "any layers. With 28 layers offloaded to my RTX 3090 I get 24 t/s.",
    },
    {
        "model": "mixtral-8x7b",
        "target": "other",
        "engine": "Fiddler (paper, v1 abstract)",
        "quantization": "uncompressed (16-bit, >90 GB)",
        "gpu": "a single GPU with 24 GB (model not named in the abstract)",
        "cpu": None,
        "setting": "experts split CPU/GPU, CPU computes experts in RAM; 'over 3' tokens/s",
        "decode_tokens_per_s": 3,
        "prefill_tokens_per_s": None,
        "source": "https://paperswithcode.com/paper/fiddler-cpu-gpu-orchestration-for-fast "
        "(arXiv 2402.07033 v1 abstract)",
        "quote": "Fiddler can run the uncompressed Mixtral-8x7B model, which exceeds 90GB in parameters, "
        "to generate over 3 tokens per second on a single GPU with 24GB memory",
    },
    {
        "model": "mixtral-8x7b",
        "target": "other",
        "engine": "MoE-Infinity",
        "quantization": "FP16",
        "gpu": "RTX A5000 24 GB",
        "cpu": None,
        "setting": "expert offloading to host memory; published as per-token latency 0.735 s "
        "(not converted here); same table: Mixtral Offloading 1.752 s, Ollama 0.903 s, vLLM 2.137 s",
        "decode_tokens_per_s": None,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/EfficientMoE/MoE-Infinity/blob/main/README.md (Performance)",
        "quote": "Single GPU A5000 (24GB Memory), per-token-latency (seconds) ... MoE-Infinity (FP16) | "
        "0.100 | 0.735 | 0.150 (DeepSeek-V2-Lite, Mixtral-8x7b, Qwen3-30B-A3B)",
    },
    {
        "model": "qwen3-30b-a3b",
        "target": "other",
        "engine": "MoE-Infinity",
        "quantization": "FP16",
        "gpu": "RTX A5000 24 GB",
        "cpu": None,
        "setting": "expert offloading; per-token latency 0.150 s (not converted); "
        "vLLM v0.8.5 0.205 s, DeepSpeed 7.857 s in the same legacy table",
        "decode_tokens_per_s": None,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/EfficientMoE/MoE-Infinity/blob/main/README.md (Performance)",
        "quote": "| MoE-Infinity | 0.119 | 0.735 | 0.100 | 0.150 | (NLLB, Mixtral, DeepSeek-V2-Lite, "
        "Qwen3-30B-A3B) ... | vLLM (v0.8.5) | X | 2.137 | 0.149 | 0.205 |",
    },
    # ---------------- vLLM / SGLang ----------------
    {
        "model": "kimi-k2 (int4)",
        "target": "other",
        "engine": "vLLM --cpu-offload-gb (before selective-offload PR)",
        "quantization": "nvidia/Kimi-K2-Thinking-NVFP4 (4-bit NVFP4)",
        "gpu": "1x GB300",
        "cpu": "Grace (GB300 host)",
        "setting": "--cpu-offload-gb 350; single user (max-concurrency 1, 100 in / 100 out); "
        "the PR's 'after' figure (--cpu-offload-params w13_weight w2_weight) not in the stored text",
        "decode_tokens_per_s": 15,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/vllm-project/vllm/pull/34535",
        "quote": "Tested offloading Kimi K2 NVFP4 on one GB300. ... Benchmarking single-user throughput ... "
        "Before: 15 tok/s",
    },
    {
        "model": "deepseek-v3 (fp8)",
        "target": "other",
        "engine": "SGLang (user report, no offload)",
        "quantization": "DeepSeek-R1 FP8 (original weights)",
        "gpu": "2 nodes x 8 H100 80GB (16 GPUs), --tp 16",
        "cpu": None,
        "setting": "no offload; workload/concurrency not stated",
        "decode_tokens_per_s": 19,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/sgl-project/sglang/issues/3656",
        "quote": "2*H100 2*8*80G部署DeepSeek R1,推理速度只有19tokens/s,vllm部署的推理速度有30tokens/s",
    },
    {
        "model": "deepseek-v3 (fp8)",
        "target": "other",
        "engine": "vLLM (user report, no offload)",
        "quantization": "DeepSeek-R1 FP8 (original weights)",
        "gpu": "2 nodes x 8 H100 80GB (16 GPUs)",
        "cpu": None,
        "setting": "no offload; workload/concurrency not stated",
        "decode_tokens_per_s": 30,
        "prefill_tokens_per_s": None,
        "source": "https://github.com/sgl-project/sglang/issues/3656",
        "quote": "2*H100 2*8*80G部署DeepSeek R1,推理速度只有19tokens/s,vllm部署的推理速度有30tokens/s",
    },
]
