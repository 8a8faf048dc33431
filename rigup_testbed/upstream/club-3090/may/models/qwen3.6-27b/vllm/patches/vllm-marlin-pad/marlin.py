print("club3090 stand-in: vllm-marlin-pad/marlin.py applied")
