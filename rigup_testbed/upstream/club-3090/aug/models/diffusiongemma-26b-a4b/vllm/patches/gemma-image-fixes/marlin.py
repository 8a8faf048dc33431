print("club3090 stand-in: gemma-image-fixes/marlin.py applied")
