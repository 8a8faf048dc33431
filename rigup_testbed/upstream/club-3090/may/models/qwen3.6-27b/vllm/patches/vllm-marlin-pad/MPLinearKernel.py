print("club3090 stand-in: vllm-marlin-pad/MPLinearKernel.py applied")
