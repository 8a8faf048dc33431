print("club3090 stand-in: w4a8-int8-act/patch-negscale-fold.py applied")
