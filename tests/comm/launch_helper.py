# Helpers for the launch tests that need more than one command (run_expect.cmake starts them).
#
#   python launch_helper.py silent-listener <command> <args...>
#     Runs the command while a TCP listener on 127.0.0.1 accepts connections and never answers
#     (a stand-in for a program that holds MASTER_PORT but is no rendezvous store).
#     @SILENT_PORT@ in the arguments becomes its port; the exit code is the command's.
#
#   python launch_helper.py together <command 1...> -- <command 2...> [-- ...]
#     Runs the commands at the same time and waits for all of them; prints
#     "exit codes: <c1> <c2> ..." and exits 0 only when every command exited 0.
import socket
import subprocess
import sys
import threading


def silent_listener(command):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    port = str(server.getsockname()[1])
    held = []

    def accept_and_say_nothing():
        while True:
            connection, _ = server.accept()
            held.append(connection)  # kept open, never read from or written to

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    return subprocess.call([arg.replace("@SILENT_PORT@", port) for arg in command])


def together(args):
    commands = [[]]
    for arg in args:
        if arg == "--":
            commands.append([])
        else:
            commands[-1].append(arg)
    processes = [subprocess.Popen(command) for command in commands if command]
    codes = [process.wait() for process in processes]
    print("exit codes: " + " ".join(str(code) for code in codes), flush=True)
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    modes = {"silent-listener": silent_listener, "together": together}
    if len(sys.argv) < 3 or sys.argv[1] not in modes:
        sys.exit("usage: launch_helper.py silent-listener|together <command...>")
    sys.exit(modes[sys.argv[1]](sys.argv[2:]))
