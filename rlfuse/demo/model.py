"""The policy: a randomly initialised byte-level Llama (2 layers, hidden 64) with LoRA adapters
on the attention projections. Nothing is downloaded; transformers and peft are imported here
only, so ``import rlfuse`` never needs them."""
from __future__ import annotations

import copy
import warnings

import torch

VOCAB_SIZE = 257          # the 256 byte values and an end-of-sequence token
EOS = 256


def build_policy(seed: int, device: torch.device, *, lora_rank: int = 8):
    try:
        import peft
        import transformers
    except ImportError as err:
        raise ImportError("the demo needs transformers and peft: pip install -e '.[train]'") \
            from err
    torch.manual_seed(seed)  # the random init of the model and of the LoRA matrices
    # initializer_range 0.1 rather than the usual 0.02: the output head stays frozen and random,
    # and at 0.02 its logits span about ±1, too little for any adapter to favour a byte class.
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=False,
        initializer_range=0.1)
    model = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    with warnings.catch_warnings():  # peft probes an attribute that recent transformers deprecate
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                category=FutureWarning)
        return peft.get_peft_model(model, lora).to(device)


def frozen_copy(model):
    """An independent copy that is never trained (behavior, reference or teacher policy)."""
    frozen = copy.deepcopy(model).eval()
    frozen.requires_grad_(False)
    return frozen


def load_weights(dst, src) -> None:
    """Refresh a frozen copy from the learner."""
    dst.load_state_dict(src.state_dict())


def next_token_logits(model, sequences: torch.Tensor) -> torch.Tensor:
    """``[B, L, V]``: ``logits[:, t]`` predicts ``sequences[:, t + 1]``."""
    return model(input_ids=sequences, use_cache=False).logits


def last_hidden_and_head(model, sequences: torch.Tensor):
    """``(hidden [B, L, H], weight [V, H])``: the last (normed) hidden states and the output
    head, not applied — ``hidden[:, t] @ weight.T`` are the logits that predict
    ``sequences[:, t + 1]``."""
    causal_lm = model.get_base_model()
    hidden = causal_lm.model(input_ids=sequences, use_cache=False).last_hidden_state
    return hidden, causal_lm.lm_head.weight
