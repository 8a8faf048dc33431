print("club3090 stand-in: gemma-image-fixes/marlin_utils_fp8.py applied")
