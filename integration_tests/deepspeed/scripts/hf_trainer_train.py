"""A Hugging Face Trainer script as its users write it, with no prism edit: TrainingArguments from the command line
(``--deepspeed ds.json`` among them), a small Llama, the Trainer's own AdamW and loop.

    deepspeed --num_gpus 1 hf_trainer_train.py --deepspeed ds.json --output_dir OUT --max_steps 2 ...
"""
import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))
Trainer(model=model, args=args, train_dataset=Tokens()).train()
print("TRAINED", flush=True)
