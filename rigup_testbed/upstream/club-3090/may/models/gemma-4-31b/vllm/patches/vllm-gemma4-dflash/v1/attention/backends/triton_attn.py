print("club3090 stand-in: vllm-gemma4-dflash/v1/attention/backends/triton_attn.py applied")
