/*
llmc/emulator/shim/sanitizer_python.cpp: a Python interpreter linked with a sanitizer runtime
(-fsanitize=thread, or address,undefined), so that the emulated device's sanitizer builds can be
loaded from Python: ThreadSanitizer must be in the executable, not preloaded into python3.
llmc/emulator/build.py (sanitizer_python) compiles it; it runs exactly as `python3 ARGS...`.
*/
#include <Python.h>

int main(int argc, char** argv) {
    wchar_t** wide = new wchar_t*[argc];
    for (int i = 0; i < argc; i++) {
        wide[i] = Py_DecodeLocale(argv[i], nullptr);
    }
    return Py_Main(argc, wide);
}
