"""Model code: the AR decoder family, diffusion components, the checkpoint loader, tiny builders."""
