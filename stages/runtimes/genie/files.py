"""The names of the files a Genie bundle holds, for every module that writes or reads one (stdlib only:
push and run import it in the tools image)."""

GENIE_CONFIG = "genie_config.json"
HTP_EXT_CONFIG = "htp_backend_ext_config.json"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The QAIRT libraries Genie loads on the phone (pushed beside the bundle) and that `make doctor` looks for.
QAIRT_RUNTIME_LIBS = ("libGenie.so", "libQnnHtp.so", "libQnnSystem.so")
