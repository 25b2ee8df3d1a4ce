"""A SentencePiece model (T5 tokenizer) trained once per session on the small test corpus."""
import pytest


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory) -> str:
    from tests.data.corpus import make_spm
    return make_spm(str(tmp_path_factory.mktemp("inference_spm")))
