print("club3090 stand-in: patch_inputs_embeds_optional.py applied")
