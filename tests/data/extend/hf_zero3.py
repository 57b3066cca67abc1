"""HF Trainer with DeepSpeed ZeRO-3 on the CPU: a tiny GPT-2 built from a config (nothing
downloaded), two ranks on gloo under torchrun. Rank 0 prints `STAGE=<n> LOSS=<first> <last>`."""
import math
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

DS_CONFIG = {  # a raw DeepSpeed config with explicit values (no HF "auto"), matching the arguments below
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "train_batch_size": 8,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
}


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.arange(32) % 16 + (i % 4)  # a learnable pattern
        return {"input_ids": ids, "labels": ids.clone()}


def main():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=64, n_positions=32))
    args = TrainingArguments(output_dir="/tmp/hf-zero3", per_device_train_batch_size=4, max_steps=12, learning_rate=3e-3,
                             logging_steps=1, use_cpu=True, deepspeed=DS_CONFIG, report_to=[], save_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    stage = trainer.model_wrapped.zero_optimization_stage()
    if int(os.environ.get("RANK", "0")) == 0:
        ok = all(math.isfinite(x) for x in losses)
        print(f"STAGE={stage} LOSS={losses[0]:.4f} {losses[-1]:.4f} FINITE={ok}", flush=True)


if __name__ == "__main__":
    main()
