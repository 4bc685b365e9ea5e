"""The code2wav stage kind: speech-codec tokens → a waveform (Qwen2.5-Omni's token2wav: a
flow-matching DiT to a mel spectrogram, then a BigVGAN vocoder), scheduled step by step."""
