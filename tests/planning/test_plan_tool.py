"""tools/plan_layout.py: the same flags as pretrain_*.py, a Hugging Face config.json, the ranked table and --json."""
import json

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
