"""Prompt data: verl parquet/jsonl and plain jsonl, chat template, overlong filtering, errors, resumable batches."""

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tlt.config import DataConfig
from tlt.prompts import DataError, PromptExample, load_examples
from tlt.rl.data import PromptDataset

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A tiny whitespace WordLevel tokenizer with a chat template, saved and reloaded (no downloads)."""
    words = "<user> <system> <assistant> </s> what is 1 + 2 ? 3 4 5 long prompt please solve".split()
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(str(path))
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def verl_row(i: int, question: str = "what is 1 + 2 ?") -> dict:
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"split": "train", "index": i}}


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_verl_parquet_with_chat_template(tmp_path, tokenizer):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row(i) for i in range(3)]), str(path))
    examples, num_filtered = load_examples([str(path)], tokenizer)
    assert num_filtered == 0 and len(examples) == 3
    ex = examples[1]
    assert isinstance(ex, PromptExample)
    assert (ex.index, ex.data_source, ex.ground_truth, ex.ability) == (1, "openai/gsm8k", "3", "math")
    assert ex.messages == [{"role": "user", "content": "what is 1 + 2 ?"}]
    assert ex.extra_info == {"split": "train", "index": 1}
    expected = tokenizer.convert_tokens_to_ids("<user> what is 1 + 2 ? </s> <assistant>".split())
    assert ex.prompt_ids == expected


def test_verl_jsonl_and_plain_jsonl(tmp_path, tokenizer):
    verl = write_jsonl(tmp_path / "a.jsonl", [verl_row(0)])
    plain = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "please solve 4 + 5", "answer": 9}])
    examples, _ = load_examples([verl, plain], tokenizer)
    assert [ex.index for ex in examples] == [0, 1]
    assert examples[1].messages == [{"role": "user", "content": "please solve 4 + 5"}]
    assert examples[1].ground_truth == "9" and examples[1].data_source == "default"
    assert examples[1].prompt_ids[0] == tokenizer.convert_tokens_to_ids("<user>")


def test_overlong_prompts_filtered_and_counted(tmp_path, tokenizer):
    rows = [verl_row(0), verl_row(1, "long " * 40 + "prompt"), verl_row(2)]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    examples, num_filtered = load_examples([path], tokenizer, max_prompt_length=16)
    assert num_filtered == 1 and [ex.index for ex in examples] == [0, 2]
    ds = PromptDataset.from_files([path], tokenizer, batch_size=2, max_prompt_length=16)
    assert ds.num_filtered == 1
    val = PromptDataset.from_config(DataConfig(val_files=[path], max_prompt_length=16), tokenizer, split="val")
    assert val.num_filtered == 1 and val.batch_size == 2 and not val.shuffle
    examples, num_filtered = load_examples([path], tokenizer, max_prompt_length=16, filter_overlong_prompts=False)
    assert num_filtered == 0 and len(examples) == 3


@pytest.mark.parametrize("bad_row, needle", [
    ("{not json", "invalid JSON"),
    ({"answer": "3"}, "missing 'prompt'"),
    ({"prompt": 42}, "'prompt' must be a string or a non-empty list"),
    ({"prompt": [{"role": "user"}]}, "{role: str, content: str}"),
    ({"prompt": "hi", "reward_model": "3"}, "'reward_model' must be an object"),
    ([1, 2], "row must be an object"),
])
def test_malformed_row_names_file_and_row(tmp_path, tokenizer, bad_row, needle):
    path = write_jsonl(tmp_path / "bad.jsonl", [verl_row(0), verl_row(1), bad_row])
    with pytest.raises(DataError) as e:
        load_examples([path], tokenizer)
    assert f"{path}, row 3" in str(e.value) and needle in str(e.value)


def test_missing_file_and_bad_extension(tmp_path, tokenizer):
    with pytest.raises(DataError, match="not found: .*nope.parquet"):
        load_examples([str(tmp_path / "nope.parquet")], tokenizer)
    (tmp_path / "x.csv").write_text("prompt\nhi\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_examples([str(tmp_path / "x.csv")], tokenizer)


def make_dataset(n: int, batch_size: int, **kw) -> PromptDataset:
    examples = [PromptExample(index=i, data_source="d", messages=[], ground_truth=None) for i in range(n)]
    return PromptDataset(examples, batch_size, **kw)


def test_shuffle_is_deterministic_per_epoch_and_resumable():
    ds = make_dataset(10, 3, seed=7)
    epoch0 = [[ex.index for ex in ds.next_batch()] for _ in range(3)]  # 3 full batches; 1 example dropped
    flat = sum(epoch0, [])
    assert len(set(flat)) == 9 and flat != list(range(9))
    again = make_dataset(10, 3, seed=7)
    assert [[ex.index for ex in again.next_batch()] for _ in range(3)] == epoch0

    state = ds.state_dict()
    assert state["epoch"] == 0 and state["index"] == 9
    expected = [[ex.index for ex in ds.next_batch()] for _ in range(4)]  # crosses into epoch 1, then epoch 2
    assert ds.epoch == 2 and expected[0] != epoch0[0]
    resumed = make_dataset(10, 3, seed=7)
    resumed.load_state_dict(state)
    assert [[ex.index for ex in resumed.next_batch()] for _ in range(4)] == expected


def test_no_shuffle_and_validation_iteration():
    ds = make_dataset(5, 2, shuffle=False)
    assert [ex.index for ex in ds.next_batch()] == [0, 1]
    assert [[ex.index for ex in b] for b in ds.iter_batches(2)] == [[0, 1], [2, 3], [4]]
    assert len(list(make_dataset(5, None).iter_batches())) == 1  # batch_size None: everything at once
    with pytest.raises(DataError, match="batch_size=6"):
        make_dataset(5, 6)


def test_sd_comparison_times_the_next_rollout_not_the_last():
    """tlt train's closing SD comparison samples what step total_steps + 1 would: the next prompts with that step's
    seeds, which the drafter never trained on; the data stream is not advanced. Control: the last step's rollout."""
    from types import SimpleNamespace

    from tlt.config import Config
    from tlt.rl.rollout import rollout_seed, sampling_params_for
    from tlt.rl.run_summary import next_rollout
    cfg = Config()
    cfg.trainer.total_steps, cfg.rollout.n = 3, 4
    data = make_dataset(12, 4, seed=1)
    last = None
    for step in range(1, 4):  # the run's three steps, as collect_rollouts draws them (one rank)
        last = (data.next_batch(), sampling_params_for(4, 4, cfg.rollout.temperature, cfg.rollout.top_p,
                                                       cfg.rollout.top_k, cfg.data.max_response_length,
                                                       rollout_seed(cfg.trainer.seed, step), first_prompt=0))
    trainer = SimpleNamespace(cfg=cfg, train_data=data, prompts_per_rank=4, dist=SimpleNamespace(rank=0))
    prompts, params = next_rollout(trainer)
    assert (data.epoch, data.position) == (0, 12)  # not advanced
    assert [p.index for p in next_rollout(trainer)[0]] == [p.index for p in prompts]
    assert [p.index for p in prompts] == [p.index for p in data.peek_batch()]  # what step 4 would roll out
    assert [p.index for p in prompts] == [p.index for p in copy.copy(data).next_batch()]
    assert [p.seed for p in params] == [rollout_seed(cfg.trainer.seed, 4) + j * 4 for j in range(4)]
    assert {p.seed for p in params}.isdisjoint(p.seed for p in last[1])
    assert not any(p.return_hidden_states for p in params) and all(p.n == 4 for p in params)
    # rank 1 of two: its half of the same global batch, seeds numbered from its first prompt
    trainer.dist.rank, trainer.prompts_per_rank = 1, 2
    prompts1, params1 = next_rollout(trainer)
    assert [p.index for p in prompts1] == [p.index for p in data.peek_batch()[2:]]
    assert [p.seed for p in params1] == [rollout_seed(cfg.trainer.seed, 4) + j * 4 for j in (2, 3)]
