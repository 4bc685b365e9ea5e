"""The code2wav stage kind: speech-codec tokens → a waveform, synthesised step by step by the
vocoder of the checkpoint's model family (``omnistage.models.registry``)."""
