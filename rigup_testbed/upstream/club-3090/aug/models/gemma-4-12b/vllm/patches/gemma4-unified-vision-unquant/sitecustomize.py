# rigup stand-in: the gemma4_unified vision-embedder workaround (loaded through PYTHONPATH)
import sys

print("club3090 stand-in: gemma4-unified-vision-unquant sitecustomize loaded", file=sys.stderr)
