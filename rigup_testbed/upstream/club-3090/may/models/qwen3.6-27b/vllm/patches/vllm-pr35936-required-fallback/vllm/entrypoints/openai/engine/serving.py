print("club3090 stand-in: vllm-pr35936-required-fallback/vllm/entrypoints/openai/engine/serving.py applied")
