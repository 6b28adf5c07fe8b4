"""CapRL's caption reward (`qa`, registered as `caption_qa`) and the text-only judges it asks
(`judges`, `judge_server`): they serve only captioning, so they live beside its reward."""
