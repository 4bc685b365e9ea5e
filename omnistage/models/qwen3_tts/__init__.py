"""Qwen3-TTS (the 12 Hz tokenizer's checkpoints): a talker with its code predictor speaks text as
frames of 16 codes, and the speech tokenizer's decoder turns them into a 24 kHz waveform. Not
served yet: the parts land one at a time (the decoder first), each equal to the official
``qwen-tts`` package."""
