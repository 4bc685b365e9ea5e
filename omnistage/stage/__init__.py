"""Stage engines (AR, diffusion), their sleep control, and the stage process."""
