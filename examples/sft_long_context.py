"""Fine-tunes a transformers checkpoint on long chat conversations with TRL's SFTTrainer, memo managing the
activations: the one change to a TRL script is `memo.patch(model)`.

    python examples/sft_long_context.py --model my-llama --data chats.jsonl --max-length 128K --out runs/sft
    python examples/sft_long_context.py --tiny --out runs/sft       # a toy model, tokenizer and chats made here

`--data` is JSONL with a `messages` column (role / content). Conversations are packed padding-free (one row,
`position_ids` restarting at each, as TRL's collator sends them: each attends only to itself) and the loss covers
the assistant's tokens (`assistant_only_loss`: the chat template needs TRL's generation markers, as its
`trl/chat_templates/*_training.jinja` have). memo turns TRL's default activation checkpointing off: it keeps,
offloads and recomputes the activations itself (docs/memory.md), a plan solved from the measured layer time
unless `--alpha` fixes the share of token rows sent to the host.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
import trl
from datasets import Dataset, load_dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

import memo
from memo.units import format_bytes, parse_length

WORDS = "the cat sat on a mat and looked at one red ball while two dogs ran far away from home".split()


def toy_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Returns a byte-level tokenizer (259 ids) with ChatML's specials and TRL's Qwen2.5 training template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (Path(trl.__path__[0]) / "chat_templates" / "qwen2_5_training.jinja").read_text()
    return fast


def toy_model(seed: int = 0) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=257,
        pad_token_id=258,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def toy_chats(n: int = 16, seed: int = 0) -> Dataset:
    """Returns chats of a long document, a question and a short answer."""
    g = torch.Generator().manual_seed(seed)

    def words(k: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g))

    rows = [
        dict(
            messages=[
                dict(role="user", content=f"{words(60 + 7 * i)}\nWhat ran?"),
                dict(role="assistant", content=words(4)),
            ]
        )
        for i in range(n)
    ]
    return Dataset.from_list(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a transformers Llama, Mistral, Qwen2 or Qwen3 folder (with its tokenizer)")
    p.add_argument("--data", help="JSONL with a `messages` column")
    p.add_argument("--tiny", action="store_true", help="a toy model, tokenizer and data made here (CPU, seconds)")
    p.add_argument("--max-length", default="32K", help="tokens per packed row (e.g. 128K)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lora-rank", type=int, default=16, help="0: full fine-tuning")
    p.add_argument("--alpha", type=float, help="share of token rows sent to host (default: solved per layer)")
    p.add_argument("--out", default="runs/sft")
    args = p.parse_args(argv)
    if args.tiny == bool(args.model or args.data):
        p.error("give --model and --data, or --tiny")
    if args.tiny:
        model, tokenizer, data, max_length = toy_model(), toy_tokenizer(), toy_chats(), 512
    else:
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        data, max_length = load_dataset("json", data_files=args.data, split="train"), parse_length(args.max_length)

    model = memo.patch(model, memo.ActivationPolicy("memo", alpha=args.alpha))  # the one line memo adds

    config = SFTConfig(
        output_dir=args.out,
        max_steps=args.steps,
        learning_rate=args.lr,
        max_length=max_length,
        packing=True,
        padding_free=True,
        assistant_only_loss=True,
        per_device_train_batch_size=1,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to=[],
        save_strategy="no",
    )
    lora = (
        LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
        if args.lora_rank
        else None
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, peft_config=lora)
    trainer.train()
    trainer.save_model(args.out)
    stats = memo.patch_stats(trainer.model)
    alphas = ", ".join(f"{a:.2f}" for a in stats.alphas)
    print(f"memo: plan {' '.join(stats.modes)}, α {alphas}, tiles of {stats.tile_tokens} tokens")
    print(f"memo: {format_bytes(stats.bytes_offloaded)} offloaded to a {format_bytes(stats.host_pool_bytes)} host pool")
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
