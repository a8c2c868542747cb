"""The text corpus read from S3 (a moto server on 127.0.0.1) exactly as from local files."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
from text_corpus import data_cfg, decode_docs, read_all, train_tok, write_mixed

from intellect.data.corpus import Corpus, CorpusReader, Cursor
from intellect.data.text import PackedStream, is_heldout_text


@pytest.fixture
def mixed(tmp_path: Path) -> tuple[Path, list[str]]:
    return write_mixed(tmp_path / "corpus")


@pytest.mark.slow
def test_s3_prefix_and_key_read_like_local_files(mixed, bucket: str, s3_env: str, monkeypatch) -> None:
    root, texts = mixed
    tok = train_tok()
    client = boto3.client("s3", endpoint_url=s3_env)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"corpus/{path.relative_to(root)}", Body=path.read_bytes())
    prefix = data_cfg([f"s3://{bucket}/corpus/"])
    corpus = Corpus(prefix.text)
    assert len(corpus.files) == 22 and all(r.name.startswith(f"s3://{bucket}/corpus/") for r in corpus.files)
    reader = CorpusReader(corpus, lambda e: "fixed")
    stats: dict[str, int] = {}
    assert sorted(d[2] for d in reader.stream(Cursor(), lambda r, c: True, epochs=1, stats=stats)) == sorted(texts)
    assert stats["row_groups"] == 3
    train = {t for t in texts if not is_heldout_text(t, 10)}
    assert set(decode_docs(tok, read_all(PackedStream(prefix, tok, epochs=2)))) == train
    # explicit options win over the environment
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    one = Corpus(data_cfg([f"s3://{bucket}/corpus/rows.parquet"]).text, {"endpoint_url": s3_env, "region": "us-east-1"})
    got = [d[2] for d in CorpusReader(one, lambda e: "x").stream(Cursor(0, 0, 10, 0), lambda r, c: True, epochs=1)]
    assert got == texts[50:]
    with pytest.raises(ValueError, match="unknown storage_options"):
        Corpus(prefix.text, {"endpont": "x"})
