"""A patched model under `transformers.Trainer` and TRL's `SFTTrainer`, with no change to the training script but
the patch call: five steps give the unpatched run's losses, and SFTTrainer's entropy and accuracy, with TRL's
padding-free packing and assistant-only loss, and with right-padded completion-only batches."""

import importlib.util
from pathlib import Path

import pytest
import torch

from memo import ActivationPolicy, patch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

POLICY = ActivationPolicy("memo", alpha=0.5, tile_tokens=7)
STEPS, LOSS_TOL = 5, 1e-4


def _example():
    """The README's SFTTrainer example: its byte-level tokenizer (TRL's Qwen2.5 training template) and words."""
    path = Path(__file__).resolve().parents[1] / "examples" / "sft_long_context.py"
    spec = importlib.util.spec_from_file_location("sft_long_context", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()


def llama(patched: bool):
    """The example's toy Llama (its vocabulary is the toy tokenizer's), patched or not."""
    model = EXAMPLE.toy_model()
    return patch(model, POLICY) if patched else model


def common(tmp_path) -> dict:
    return dict(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        bf16=False,
        gradient_checkpointing=True,
        lr_scheduler_type="constant",
        dataloader_num_workers=0,
    )


def logged(trainer, key: str) -> list[float]:
    trainer.train()
    return [h[key] for h in trainer.state.log_history if key in h]


def sentence(g: torch.Generator, n: int) -> str:
    return " ".join(EXAMPLE.WORDS[i] for i in torch.randint(0, len(EXAMPLE.WORDS), (n,), generator=g))


def test_trainer_trains_a_patched_model_as_it_trains_the_model(tmp_path):
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(12):
        ids = torch.randint(0, 259, (20,), generator=g)
        labels = ids.clone()
        labels[:6] = -100
        rows.append(dict(input_ids=ids, labels=labels))
    runs = {}
    for patched in (False, True):
        args = transformers.TrainingArguments(**common(tmp_path / str(patched)))
        trainer = transformers.Trainer(model=llama(patched), args=args, train_dataset=rows)
        runs[patched] = logged(trainer, "loss")
    assert trainer.model._memo_patch.store.step == STEPS  # memo's layers ran every training forward
    assert len(runs[True]) == STEPS
    assert runs[True] == pytest.approx(runs[False], rel=LOSS_TOL)


def chat_rows(n: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(4)
    return [
        dict(
            messages=[
                dict(role="user", content=sentence(g, 4 + i % 5)),
                dict(role="assistant", content=sentence(g, 2 + i % 3)),
            ]
        )
        for i in range(n)
    ]


def completion_rows(n: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [dict(prompt=sentence(g, 3 + i % 4), completion=sentence(g, 2 + i % 3)) for i in range(n)]


PACKED = dict(packing=True, padding_free=True, assistant_only_loss=True, max_length=160)


@pytest.mark.parametrize(
    "rows, config, after",
    [
        (chat_rows, PACKED, False),
        (chat_rows, PACKED, True),
        (completion_rows, dict(packing=False, completion_only_loss=True, max_length=96), False),
    ],
    ids=["packed-padding-free-assistant-only", "patched-after-the-trainer-is-made", "padded-completion-only"],
)
def test_sft_trainer_gives_the_unpatched_losses_entropy_and_accuracy(tmp_path, rows, config, after):
    from trl import SFTConfig, SFTTrainer

    tok = EXAMPLE.toy_tokenizer()
    data = datasets.Dataset.from_list(rows())
    runs = {}
    for patched in (False, True):
        args = SFTConfig(**common(tmp_path / str(patched)), **config)
        trainer = SFTTrainer(model=llama(patched and not after), args=args, train_dataset=data, processing_class=tok)
        if patched and after:  # TRL has put its fused head on the model's forward: it calls the patched backbone
            patch(trainer.model, POLICY)
        trainer.train()
        runs[patched] = [
            (h["loss"], h["entropy"], h["mean_token_accuracy"]) for h in trainer.state.log_history if "loss" in h
        ]
    assert trainer.model._memo_patch.store.step == STEPS
    assert len(runs[True]) == STEPS
    for (loss, entropy, accuracy), (want_loss, want_entropy, want_accuracy) in zip(runs[True], runs[False]):
        assert loss == pytest.approx(want_loss, rel=LOSS_TOL)
        assert entropy == pytest.approx(want_entropy, rel=LOSS_TOL)
        assert accuracy == pytest.approx(want_accuracy, abs=1e-6)
