"""docs/checkpoints.md's continued-pretraining commands as a newcomer runs them: the block verbatim (read from the
docs; only the hub folder's name is the test's), in a folder outside the repository, with its relative paths, on
a model made by transformers as the hub ships it (weights, config.json, tokenizer.json) and a Parquet corpus:
import-hf, preprocess_data.py, examples/ds_pretrain_llama.sh with PRETRAINED alone (no model flags), export-hf.

For a tied Qwen2 and an untied Llama:
- the first logged loss equals transformers' loss on the same first batch (dropout off, fp32, relative error
  < 1e-5): the run starts from the imported weights, with the model the checkpoint describes;
- the loss falls, and transformers loads the exported folder as the same family, tied as it was;
- (Qwen2) a second launch resumes from the run's own checkpoint, not from the import.
"""
import os
import re
import pytest

from tests.training.test_readme_own_data import ROOT, run_block

FAMILIES = ("qwen2_tied", "llama_untied")
ITERS = 6


def docs_block() -> str:
    """The bash block after docs/checkpoints.md's "Continued pretraining from Llama, Mistral, Qwen2, ..." heading."""
    text = open(os.path.join(ROOT, "docs", "checkpoints.md")).read()
    section = text.split("**Continued pretraining from Llama, Mistral, Qwen2, Qwen3 or OLMo-2.**", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S)[1]


def _hub_model(family: str, folder: str) -> None:
    """A random model of `family` with a Llama-3-like tokenizer.json, saved as the hub ships it."""
    import shutil
    import torch
    import transformers
    from megatron.tokenizer import build_tokenizer
    from harness.corpus import make_llama_like
    source = os.path.join(os.path.dirname(os.path.dirname(folder)), f"tokenizer_src_{os.getpid()}")
    os.makedirs(source, exist_ok=True)
    tok_dir = make_llama_like(source)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tok_dir)
    shape = dict(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=tokenizer.bos,
                 eos_token_id=tokenizer.eos)
    torch.manual_seed(0)
    if family == "qwen2_tied":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **shape))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **shape))
    model.save_pretrained(folder)
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), folder)


def _parquet(path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from harness.corpus import make_texts
    texts = make_texts(400)
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=64)


def _losses(log: str) -> dict:
    return {int(i): float(loss) for i, loss in re.findall(r"iteration (\d+)/\d+ \|.*?\| loss ([0-9.]+)", log)}


def _transformers_first_loss(folder: str, hub: str, imported: str, run: str) -> float:
    """transformers' loss on iteration 1's batch of the run whose checkpoints are in `run`, the batch built by
    pretrain()'s own hooks at one process from the run's recorded settings (sequence, global batch, split, seed;
    its relative paths mean `folder`, where it was started)."""
    import transformers
    from megatron.checkpointing import read_checkpoint_args
    from tests.checkpoint.common import first_iteration_batches, mean_loss
    from harness.dist import run_distributed
    saved = read_checkpoint_args(run)
    assert not os.path.isabs(saved["data_path"][0]), saved["data_path"]  # as the user wrote it
    args = ["--use-checkpoint-args", "--pretrained-checkpoint", imported, "--num-workers", "0", "--lr", "1e-3",
            "--data-path", *(os.path.join(folder, p) for p in saved["data_path"]), "--tokenizer-type",
            saved["tokenizer_type"], "--tokenizer-model", os.path.join(folder, saved["tokenizer_model"])]
    for name in ("seq_length", "micro_batch_size", "global_batch_size", "train_iters", "split", "seed"):
        args += ["--" + name.replace("_", "-"), str(saved[name])]
    batches = run_distributed(first_iteration_batches, 1, "gpt2", args, timeout=300)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(hub, dtype="float32").eval()
    return mean_loss(lambda tokens, *rest: model(tokens).logits, batches)


@pytest.mark.long
@pytest.mark.parametrize("family", FAMILIES)
def test_the_docs_recipe_from_a_folder_of_ones_own(family, tmp_path):
    block = docs_block()
    assert "path/to/Llama-3.2-1B" in block and "$REPO/examples/ds_pretrain_llama.sh" in block, block
    mine = tmp_path / "my_project"
    mine.mkdir()
    _hub_model(family, str(mine / "hub_model"))
    _parquet(str(mine / "fineweb_000.parquet"))
    env = dict(NPROC="4", TRAIN_ITERS=str(ITERS), LOG_INTERVAL="1", EVAL_INTERVAL="100", EVAL_ITERS="1")
    log = run_block(block.replace("path/to/Llama-3.2-1B", "hub_model"), str(mine), env)
    assert "starting from the weights of --pretrained-checkpoint" in log and "(tp, pp, dp) = (2, 2, 1)" in log, \
        log[-3000:]
    losses = _losses(log)
    assert sorted(losses) == list(range(1, ITERS + 1)) and losses[ITERS] < losses[1], log[-3000:]
    expected = _transformers_first_loss(str(mine), str(mine / "hub_model"), str(mine / "runs" / "imported"),
                                        str(mine / "runs" / "llama" / "checkpoints"))
    assert abs(losses[1] - expected) / expected < 1e-5, (losses[1], expected)

    import transformers
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(mine / "runs" / "llama" / "hf"))
    kind = "Qwen2ForCausalLM" if family == "qwen2_tied" else "LlamaForCausalLM"
    assert type(exported).__name__ == kind and exported.config.tie_word_embeddings == (family == "qwen2_tied")
    if family == "qwen2_tied":  # a second launch resumes from the run's own checkpoint
        launch = re.search(r"^PRETRAINED=.*?ds_pretrain_llama\.sh$", block, re.S | re.M)[0]
        again = run_block(launch, str(mine), dict(env, TRAIN_ITERS=str(ITERS + 2)))
        assert "pretrained-checkpoint" not in again and sorted(_losses(again)) == [ITERS + 1, ITERS + 2], \
            again[-3000:]
