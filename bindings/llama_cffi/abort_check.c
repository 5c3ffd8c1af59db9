/* llama_set_abort_callback's check for decodes outside Python's main thread: it reads a word
 * the Python side sets when the exchange is cancelled, and needs no GIL. (A callback written in
 * Python re-enters the interpreter at every graph node: with another Python thread busy, each
 * call waits for the GIL and the decode ran 1.8 to 2.3 times slower.) */
#include <stdbool.h>

bool llmsession_should_abort(void *flag) {
    return *(const volatile int *)flag != 0;
}
