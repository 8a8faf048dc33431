print("club3090 stand-in: gemma-image-fixes/diffusion_gemma.py applied")
