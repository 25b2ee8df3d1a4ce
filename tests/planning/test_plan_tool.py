"""tools/plan_layout.py: the same flags as pretrain_*.py, a Hugging Face config.json, the ranked table and --json."""
import json

import pytest

from megatron.planning.speed import Cluster
from tools.plan_layout import main

GPT2_MEDIUM = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
               "--global-batch-size", "64", "--bf16", "--gpus-per-node", "8", "--gpu", "h100"]


def test_table_ranks_fitting_layouts_first(capsys):
    main(GPT2_MEDIUM + ["--top", "5"])
    out = capsys.readouterr().out.splitlines()
    assert "layouts fit" in out[0] and out[1].lstrip().startswith("#")
    assert all(" yes " in row for row in out[2:7])


def test_json_holds_every_part(capsys):
    main(GPT2_MEDIUM + ["--json", "--gpu-memory-gb", "8"])
    data = json.loads(capsys.readouterr().out)
    cands = data["candidates"]
    assert any(c["fits"] for c in cands) and not all(c["fits"] for c in cands)
    worst = max(cands[0]["stages"], key=lambda s: s["peak"])
    assert {"weights", "gradients", "optimizer", "activations", "buffers", "in_flight"} <= set(worst)
    assert set(cands[0]["step"]) >= {"compute", "bubble", "tp_comm", "dp_comm", "pp_comm", "total"}
    for c in cands:
        lay = c["layout"]
        assert lay["tp"] * lay["pp"] * lay["dp"] == 8 and lay["tp"] <= 8


def test_cluster_flags_reach_the_cluster(capsys):
    """Each cluster flag lands in its own field (the fields the flags leave alone keep their defaults)."""
    main(GPT2_MEDIUM + ["--json", "--allocator-overhead", "0.07", "--hop-latency-ms", "0.5", "--instruction-ms",
                        "0.25", "--efficiency", "0.3", "--inter-node-gbps", "12"])
    c = json.loads(capsys.readouterr().out)["cluster"]
    assert (c["allocator_overhead"], c["hop_latency_ms"], c["instruction_ms"], c["efficiency"],
            c["inter_gbps"]) == (0.07, 0.5, 0.25, 0.3, 12.0)
    assert c["saturation_tokens"] == Cluster().saturation_tokens and c["memory_gb"] == 80.0


def test_hugging_face_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "t5", "num_layers": 6, "num_decoder_layers": 6, "d_model": 512,
                               "num_heads": 8, "d_kv": 64, "d_ff": 2048, "vocab_size": 32128,
                               "feed_forward_proj": "relu"}))
    main(["--hf-config", str(cfg), "--seq-length", "512", "--global-batch-size", "32", "--gpus-per-node", "4",
          "--top", "3"])
    assert "t5 12 layers, hidden 512, seq 512" in capsys.readouterr().out


def test_load_reads_the_checkpoints_arguments(tmp_path, capsys):
    (tmp_path / "megatron_args.json").write_text(json.dumps(
        {"model_type": "gpt", "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "seq_length": 1024,
         "max_position_embeddings": 1024, "vocab_size": 50257, "make_vocab_size_divisible_by": 128}))
    main(["--load", str(tmp_path), "--global-batch-size", "32", "--gpus-per-node", "2", "--top", "2"])
    assert "gpt 12 layers, hidden 768, seq 1024" in capsys.readouterr().out


LLAMA_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
               "--num-query-groups", "8", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
LLAMA_HF = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
            "rope_theta": 500000.0, "tie_word_embeddings": False}


def test_llama_flags_and_hugging_face_config_plan_the_same_model(tmp_path, capsys):
    """The GPT layer's flags reach the planner, and a Llama config.json means the flags import-hf would give."""
    flags = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size", "14336",
             "--seq-length", "8192", "--vocab-size", "128256", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--rotary-base", "500000", "--norm-epsilon", "1e-6", *LLAMA_FLAGS]
    common = ["--global-batch-size", "32", "--bf16", "--gpus-per-node", "8", "--json"]
    main(flags + common)
    from_flags = json.loads(capsys.readouterr().out)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_HF))
    main(["--hf-config", str(cfg), "--seq-length", "8192", *common])
    from_hf = json.loads(capsys.readouterr().out)
    model = from_flags["model"]
    assert (model["num_query_groups"], model["swiglu"], model["add_bias_linear"], model["tie_word_embeddings"],
            model["normalization"], model["position_embedding_type"]) == (8, True, False, False, "RMSNorm", "rope")
    assert from_hf["model"] == model
    first = from_flags["candidates"][0]
    assert from_hf["candidates"][0] == first
    # 8.03 B parameters (Llama 3 8B): the stages of one replica hold them all, the tp ranks 1 / tp each
    lay = first["layout"]
    assert sum(s["params"] for s in first["stages"]) * lay["tp"] == pytest.approx(8.03e9, rel=0.01)


def test_help_lists_the_planning_options_grouped_and_accepts_the_training_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) < 60
    for title in ("model shape", "batch and precision", "cluster", "output"):
        assert f"\n{title}" in text
    assert "--lr" not in text and "--train-iters" not in text and "DeepSpeed" not in text
    # a pretrain_gpt2.py command line plans as it is, aliases included
    main(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ff-hidden-size", "256",
          "--seq-length", "64", "--global-batch-size", "8", "--lr", "1e-4", "--train-iters", "10", "--top", "1"])
    assert "layouts fit" in capsys.readouterr().out


MIXTRAL_HF = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
              "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1e6, "tie_word_embeddings": False}


def test_mixtral_config_plans_its_experts(tmp_path, capsys):
    """A mixture of experts from its config.json (the Mixtral adapter): 46.7 B parameters (Mixtral 8x7B), the experts
    whole on every tensor-parallel rank (expert parallelism 1 here), tensor parallelism only with sequence
    parallelism."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MIXTRAL_HF))
    main(["--hf-config", str(cfg), "--seq-length", "4096", "--global-batch-size", "16", "--bf16", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["moe"]["num_experts"] == 8 and data["model"]["moe"]["topk"] == 2
    layouts = [c["layout"] for c in data["candidates"]]
    assert all(lay["sequence_parallel"] for lay in layouts if lay["tp"] > 1)
    one_rank = next(c for c in data["candidates"] if c["layout"]["tp"] == 1)
    assert sum(s["params"] for s in one_rank["stages"]) == pytest.approx(46.70e9, rel=0.005)


def test_expert_parallel_size_comes_from_the_flag(tmp_path, capsys):
    """--expert-model-parallel-size is planned as given (not searched): every layout at it, and where the code runs
    it only in fp32, a bf16 plan is one line."""
    from megatron.errors import UserError
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MIXTRAL_HF))
    common = ["--hf-config", str(cfg), "--seq-length", "4096", "--global-batch-size", "16", "--json",
              "--expert-model-parallel-size", "4"]
    main(common)
    layouts = [c["layout"] for c in json.loads(capsys.readouterr().out)["candidates"]]
    assert layouts and all(lay["ep"] == 4 and (lay["tp"] * lay["dp"]) % 4 == 0 for lay in layouts)
    with pytest.raises(UserError, match="runs in fp32 only for now"):
        main(common + ["--bf16"])
