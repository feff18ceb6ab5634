from common.runtime.worker import main
from decode_worker.stage import DecodeStage

if __name__ == "__main__":
    main(DecodeStage)
