"""The campaign's rules (harness/faults/judge.py) on hand-made outcomes: each status, and each way a changed result
is told from an edit the command follows."""
from harness.faults.judge import OwnerView, follow_tokenizer, follow_values, judge, same_outcome
from harness.faults.results import MISSING, changes, normalized

PRISTINE = {"args": {"layernorm_epsilon": 1e-05, "hf_token_ids": {"eos_token_id": 0}, "num_layers": 2}}
CONFIG = {"layer_norm_epsilon": 1e-05, "eos_token_id": 0, "n_layer": 2}


def _judge(value, follow=follow_values, owner=None, status="ok"):
    owner = owner or OwnerView(CONFIG, CONFIG)
    return judge("export/config.json", status, value, PRISTINE, follow, owner)[0]


def test_refusals_and_failures():
    assert _judge("export/config.json has vocab_size 'x'", status="UserError") == "refused"
    assert _judge("config.json has vocab_size 'x'", status="UserError") == "refused"  # its name is enough
    assert _judge("a vocab_size of 'x'", status="UserError") == "unnamed"
    assert _judge("no result after 60 s", status="Hang") == "hang"
    assert _judge("boom", status="KeyError") == "traceback"


def test_unchanged_needs_the_whole_result_equal():
    assert _judge({"args": dict(PRISTINE["args"])}) == "unchanged"
    assert _judge({"args": dict(PRISTINE["args"], num_layers=True)}) == "silent"  # True is not 2, nor 1
    assert _judge({"args": dict(PRISTINE["args"], extra=None)}) == "silent"  # a key more


def test_as_written_follows_the_files_change_exactly():
    edited = dict(CONFIG, layer_norm_epsilon=1e-04)
    owner = OwnerView(CONFIG, edited)
    follows = {"args": dict(PRISTINE["args"], layernorm_epsilon=1e-04)}
    assert _judge(follows, owner=owner) == "as written"
    also_layers = {"args": dict(follows["args"], num_layers=3)}
    assert _judge(also_layers, owner=owner) == "silent"  # the file did not say 3 layers
    assert _judge(follows, owner=OwnerView(CONFIG, CONFIG)) == "silent"  # the file says nothing changed
    assert _judge(follows, follow=None, owner=owner) == "silent"  # a kind with integrity records


def test_a_removed_key_is_followed_as_missing():
    owner = OwnerView(CONFIG, {k: v for k, v in CONFIG.items() if k != "eos_token_id"})
    dropped = {"args": dict(PRISTINE["args"], hf_token_ids={})}
    assert (("args", "hf_token_ids", "eos_token_id"), 0, MISSING) in changes(PRISTINE, dropped)
    assert _judge(dropped, owner=owner) == "as written"


def test_a_file_its_owner_refuses_is_silent_even_with_the_result_unchanged():
    assert _judge(PRISTINE, owner=OwnerView(CONFIG, refuses="json: Expecting value")) == "silent"


def test_follow_tokenizer_compares_with_the_owners_tokenizer_and_nothing_else():
    pristine = {"tokenizer": {"ids": [[5, 6]], "vocab_size": 512}, "config": {"lr": 1e-3}}
    owner_reads = {"ids": [[5, 7]], "vocab_size": 512}
    assert follow_tokenizer(None, owner_reads, pristine, dict(pristine, tokenizer=owner_reads)) == []
    other_ids = dict(pristine, tokenizer={"ids": [[5, 8]], "vocab_size": 512})
    assert follow_tokenizer(None, owner_reads, pristine, other_ids) == [(("tokenizer", "ids", 0, 1), 7, 8)]
    config_too = {"tokenizer": owner_reads, "config": {"lr": 2e-3}}
    assert follow_tokenizer(None, owner_reads, pristine, config_too) == [(("config", "lr"), 1e-3, 2e-3)]


def test_follow_tokenizer_lets_the_vocabulary_sizes_follow_the_owners():
    """A SentencePiece model that lost a piece: the run's vocab_size follows the owner's, padded as Megatron pads
    (to a multiple of 8 x tp here); any other number is unexplained."""
    config = {"record": {"make_vocab_size_divisible_by": 8, "vocab_size": 608, "padded_vocab_size": 608},
              "layout": {"tp": 1}}
    pristine = {"tokenizer": {"vocab_size": 608}, "config": config}
    fewer = {"vocab_size": 607}
    follows = {"tokenizer": fewer, "config": dict(config, record=dict(config["record"], vocab_size=607))}
    assert follow_tokenizer(None, fewer, pristine, follows) == []
    much_fewer = {"vocab_size": 600}
    padded = {"tokenizer": much_fewer, "config": dict(config, record=dict(config["record"], vocab_size=600,
                                                                          padded_vocab_size=600))}
    assert follow_tokenizer(None, much_fewer, pristine, padded) == []
    wrong = {"tokenizer": fewer, "config": dict(config, record=dict(config["record"], vocab_size=606))}
    assert follow_tokenizer(None, fewer, pristine, wrong) == [(("config", "record", "vocab_size"), 608, 606)]


def test_normalization_replaces_the_case_folder_only(tmp_path):
    folder = str(tmp_path / "case")
    result = {"vocab_file": f"{folder}/out/vocab.json", "save": "out", "other": "/elsewhere/file", "lr": 0.001}
    assert normalized(result, folder) == {"vocab_file": "<case>/out/vocab.json", "save": "out",
                                          "other": "/elsewhere/file", "lr": 0.001}


def test_same_outcome_through_the_command():
    assert same_outcome(("refused", "x.json: bad"), ("refused", "x.json: bad")) is None
    assert same_outcome(("refused", "x.json: bad"), ("refused", "x.json: worse")).startswith("another line")
    assert same_outcome(("accepted", ""), ("traceback", "exit 1: Traceback")).startswith("traceback through")
    assert same_outcome(("as written", "the file says ..."), ("as written", "")) is None
