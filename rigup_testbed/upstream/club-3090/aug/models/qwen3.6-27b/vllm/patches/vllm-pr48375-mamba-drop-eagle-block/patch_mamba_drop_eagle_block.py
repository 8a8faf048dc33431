print("club3090 stand-in: vllm-pr48375-mamba-drop-eagle-block/patch_mamba_drop_eagle_block.py applied")
