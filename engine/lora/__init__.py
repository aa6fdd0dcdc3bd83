"""Multi-LoRA serving: PEFT adapter loading, rank-class device slots, batched ops, adapter tiers."""
